"""The `spmd` command: `spmd demo` trains a GPT with data + tensor parallelism; `spmd tour` is a guided tour of
meshes, layouts, DTensors and SPMD expansion."""

from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

import spmd
from spmd import UNSHARDED, Layout
from spmd.demo.train import DemoArgs, check_args, load_corpus, parse_mesh, run
from spmd.mesh import short_device_names


def _components(console: Console, title: str, t: spmd.DTensor) -> None:
    table = Table(title=f"{title}  layout={spmd.fetch_layout(t).sharding_specs}  global shape={tuple(t.shape)}")
    table.add_column("device")
    table.add_column("component")
    for device, component in zip(short_device_names(spmd.fetch_layout(t).mesh.local_devices()), spmd.unpack(t)):
        table.add_row(device, str(component.tolist()))
    console.print(table)


def _from_array(values, layout: Layout) -> spmd.DTensor:
    """The tutorial's `dtensor_from_array`: replicate onto the mesh, then shard to `layout`."""
    replicated = spmd.copy_to_mesh(torch.tensor(values), Layout.replicated(layout.mesh, layout.rank))
    return spmd.relayout(replicated, layout)


def tour(args) -> int:
    console = Console()
    devices = [f"CPU:{i}" for i in range(6)]  # virtual CPU devices: any number, nothing to configure
    console.rule("[bold]1. Meshes: named grids of devices")
    mesh_1d = spmd.create_mesh([("x", 6)], devices=devices)
    mesh = spmd.create_mesh([("x", 3), ("y", 2)], devices=devices)
    console.print(f"create_mesh([('x', 6)])          -> dims {mesh_1d.dim_names}, shape {mesh_1d.shape()}")
    console.print(f"create_mesh([('x', 3), ('y', 2)]) -> dims {mesh.dim_names}, shape {mesh.shape()}")
    console.print(f"TF string: [dim]{mesh.to_string()[:60]}...[/dim]")

    console.rule("[bold]2. Layouts: one sharding spec per tensor axis")
    a = torch.arange(6).reshape(3, 2)
    for specs in (["x", "y"], [UNSHARDED, UNSHARDED], ["x", UNSHARDED]):
        _components(console, f"arange(6).reshape(3, 2) as {specs}", _from_array(a.tolist(), Layout(specs, mesh)))

    console.rule("[bold]3. Ops run on every device's component (SPMD expansion)")
    left = [[1, 2, 3], [4, 5, 6]]
    right = [[6, 5], [4, 3], [2, 1]]
    cases = [([UNSHARDED, UNSHARDED], [UNSHARDED, UNSHARDED], "replicated: 6 identical local matmuls"),
             ([UNSHARDED, "x"], ["x", UNSHARDED], "contracted axis sharded on x: local matmul + all-reduce over x"),
             (["y", "x"], ["x", UNSHARDED], "plus rows sharded on y: the sharding carries to the result")]
    for a_specs, b_specs, what in cases:
        c = torch.matmul(_from_array(left, Layout(a_specs, mesh)), _from_array(right, Layout(b_specs, mesh)))
        _components(console, f"{a_specs} @ {b_specs}: {what}", c)

    console.rule("[bold]4. Autograd and torch.optim: data + model parallel on a 2x2 mesh")
    _train(console, args.steps)
    console.rule("[bold green]done")
    console.print("Next: docs/guide.md; `pytest` runs the layout sweeps that check every op against plain torch.")
    return 0


def _train(console: Console, steps: int) -> None:
    torch.manual_seed(0)
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    w1, w2 = torch.randn(8, 16) / 3, torch.randn(16, 1) / 4
    params = [spmd.DVariable(w1, layout=Layout([UNSHARDED, "model"], mesh)),
              spmd.DVariable(w2, layout=Layout(["model", UNSHARDED], mesh))]
    plain = [w1.clone().requires_grad_(), w2.clone().requires_grad_()]
    dx = spmd.copy_to_mesh(x, Layout(["batch", UNSHARDED], mesh))
    dy = spmd.copy_to_mesh(y, Layout(["batch", UNSHARDED], mesh))
    opt, plain_opt = torch.optim.SGD(params, lr=0.05, momentum=0.9), torch.optim.SGD(plain, lr=0.05, momentum=0.9)
    table = Table(title="x: ['batch', U], w1: [U, 'model'], w2: ['model', U]")
    for column in ("step", "spmd loss", "plain torch loss", "w1.grad layout"):
        table.add_column(column)
    for step in range(steps):
        loss = ((torch.relu(dx @ params[0]) @ params[1] - dy) ** 2).mean()
        plain_loss = ((torch.relu(x @ plain[0]) @ plain[1] - y) ** 2).mean()
        loss.backward()
        plain_loss.backward()
        table.add_row(str(step), f"{loss.item():.6f}", f"{plain_loss.item():.6f}",
                      str(spmd.fetch_layout(params[0].grad).sharding_specs))
        for o in (opt, plain_opt):
            o.step()
            o.zero_grad()
    console.print(table)
    console.print(f"parameters keep their layouts: {[spmd.fetch_layout(p).sharding_specs for p in params]}")


def demo(args, argv: list[str]) -> int:
    in_job = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 or bool(os.environ.get("DTENSOR_JOBS"))
    demo_args = DemoArgs(**{k: v for k, v in vars(args).items() if k in DemoArgs.__dataclass_fields__})
    if args.clients > 1 and not in_job:
        _devices_per_client(demo_args, args.clients)  # (the flags' errors once, before the clients start)
        return _launch_clients(args.clients, argv)
    console = Console()
    if in_job:  # one client of a multi-client job (torchrun, `--clients`, or DTENSOR_JOBS): client 0 prints
        per_client = _devices_per_client(demo_args, spmd.num_clients())
        spmd.initialize_accelerator_system("GPU" if args.device == "cuda" else "CPU",
                                           num_logical_cpu_devices=per_client)
        console = Console(quiet=spmd.client_id() != 0)
    try:
        result = run(demo_args, console)
    except ValueError as e:  # a flag the demo cannot train with: one line, as argparse reports its own errors
        raise SystemExit(f"spmd demo: error: {e}") from None
    return 0 if result.get("parity", True) else 1


def _devices_per_client(args: DemoArgs, clients: int) -> int:
    """The mesh's devices per client; the flags' errors (as `run` would raise them) as one line."""
    data, vocab = load_corpus()
    try:
        mesh_dims = parse_mesh(args.mesh)
        check_args(args, mesh_dims, vocab, len(data))
    except ValueError as e:
        raise SystemExit(f"spmd demo: error: {e}") from None
    size = math.prod(s for _, s in mesh_dims)
    if size % clients:
        raise SystemExit(f"spmd demo: error: --mesh {args.mesh} has {size} devices, which do not split over "
                         f"{clients} clients")
    return size // clients


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _launch_clients(n: int, argv: list[str]) -> int:
    """Runs the demo as `n` client processes on this machine (the environment torchrun would give them)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # as torchrun: the clients share the cores instead of each starting a thread per core
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
        procs.append(subprocess.Popen([sys.executable, "-m", "spmd.cli", *argv], env=env,
                                      stdout=None if rank == 0 else subprocess.DEVNULL))
    codes = [None] * n
    try:
        while any(c is None for c in codes):
            for rank, p in enumerate(procs):
                codes[rank] = p.poll()
                if codes[rank] not in (None, 0):  # one client failed: stop the others
                    for other in procs:
                        if other.poll() is None:
                            other.terminate()
                    for other in procs:
                        other.wait()
                    return codes[rank]
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return 0


def main(argv=None) -> int:
    defaults = DemoArgs()
    parser = argparse.ArgumentParser(prog="spmd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"spmd {spmd.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("demo", help="train a small GPT with data + tensor parallelism on virtual devices "
                                             "and check the loss curve against a single-device run")
    train.add_argument("--mesh", default=defaults.mesh, help="mesh dims, e.g. 'batch=4,model=2' (default) or "
                                                            "'batch=8'; 'model' shards the weights (Megatron)")
    train.add_argument("--steps", type=int, default=defaults.steps)
    train.add_argument("--batch-size", type=int, default=defaults.batch_size, help="global batch (sequences)")
    train.add_argument("--block-size", type=int, default=defaults.block_size, help="sequence length")
    train.add_argument("--n-layer", type=int, default=defaults.n_layer)
    train.add_argument("--n-head", type=int, default=defaults.n_head)
    train.add_argument("--d-model", type=int, default=defaults.d_model)
    train.add_argument("--dropout", type=float, default=defaults.dropout,
                       help="with dropout the check compares against a 1-device mesh (layout-invariant RNG)")
    train.add_argument("--lr", type=float, default=defaults.lr)
    train.add_argument("--device", choices=["cpu", "cuda"], default=defaults.device,
                       help="where the components live (cuda: virtual devices share the GPU)")
    train.add_argument("--seed", type=int, default=defaults.seed)
    train.add_argument("--compile", action="store_true",
                       help="run the training step under spmd.function (traced once, no per-op Python)")
    train.add_argument("--whole-step", action="store_true",
                       help="trace the training step as one graph: forward, backward and the optimizer's update "
                            "(spmd.function(whole_step=True))")
    train.add_argument("--shard-parameters", action="store_true",
                       help="also shard parameters, gradients and optimizer state over 'batch' (FSDP / ZeRO-3)")
    train.add_argument("--no-check", dest="check", action="store_false",
                       help="skip the single-device run that checks the loss curve")
    train.add_argument("--clients", type=_at_least_one, default=1,
                       help="run as this many client processes on this machine (a multi-client job over "
                            "torch.distributed, as torchrun --nproc-per-node N would); the mesh's devices are "
                            "split evenly over the clients")
    guided = commands.add_parser("tour", help="a guided tour of meshes, layouts, DTensors and SPMD expansion")
    guided.add_argument("--steps", type=_at_least_one, default=5, help="training steps in the last section")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    return demo(args, argv) if args.command == "demo" else tour(args)


if __name__ == "__main__":
    sys.exit(main())
