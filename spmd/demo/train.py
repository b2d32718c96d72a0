"""The training job behind `spmd demo`: a GPT on the bundled corpus, data + tensor parallel, checked against a
single-device run of the same model."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from importlib import resources

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

import spmd
from spmd.demo.model import GPT, GPTConfig, megatron_layouts
from spmd.layout import UNSHARDED, Layout


@dataclass
class DemoArgs:
    mesh: str = "batch=4,model=2"
    steps: int = 200
    batch_size: int = 32
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    lr: float = 3e-3
    device: str = "cpu"
    seed: int = 0
    check: bool = True
    compile: bool = False  # the training step under spmd.function (traced once)
    whole_step: bool = False  # ... as one graph: forward, backward and the update (spmd.function(whole_step=True))
    shard_parameters: bool = False  # parameters and optimizer state also sharded over "batch" (FSDP)


def parse_mesh(text: str) -> list[tuple[str, int]]:
    """`"batch=4,model=2"` -> `[("batch", 4), ("model", 2)]`."""
    try:
        dims = [(name.strip(), int(size)) for name, size in (part.split("=") for part in text.split(","))]
    except ValueError:
        raise ValueError(f"--mesh must look like 'batch=4,model=2', got {text!r}") from None
    return dims


def check_args(args: DemoArgs, mesh_dims: list[tuple[str, int]], vocab: int, corpus_len: int) -> None:
    """Raises `ValueError`, in the flags' terms, for settings the demo cannot train with."""
    for flag, value, least in (("steps", args.steps, 1), ("batch-size", args.batch_size, 1),
                               ("block-size", args.block_size, 2), ("n-layer", args.n_layer, 1),
                               ("n-head", args.n_head, 1), ("d-model", args.d_model, 1)):
        if value < least:
            raise ValueError(f"--{flag} must be at least {least}, got {value}")
    if args.block_size >= corpus_len - 1:
        raise ValueError(f"--block-size must be below {corpus_len - 1} (the corpus has {corpus_len} characters)")
    if args.d_model % args.n_head:
        raise ValueError(f"--d-model {args.d_model} must divide into --n-head {args.n_head} heads")
    if not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.shard_parameters and "batch" not in dict(mesh_dims):
        raise ValueError(f"--shard-parameters shards over the mesh dim 'batch', which --mesh {args.mesh} lacks")
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    dims = dict(mesh_dims)
    if len(dims) != len(mesh_dims) or any(size < 1 for size in dims.values()):
        raise ValueError(f"--mesh {args.mesh!r} needs distinct dimension names with sizes of at least 1")
    unknown = sorted(set(dims) - {"batch", "model"})
    if unknown:  # the demo shards over these two names only: another would silently shard nothing
        raise ValueError(f"--mesh {args.mesh!r}: the demo's mesh dimensions are 'batch' and 'model', got {unknown}")
    needs = {"batch": {"--batch-size": args.batch_size},
             "model": {"--n-head": args.n_head, "--d-model": args.d_model, "the vocabulary": vocab}}
    for dim, sizes in needs.items():
        for what, size in sizes.items():
            if size % dims.get(dim, 1):
                raise ValueError(f"mesh dimension {dim}={dims[dim]} (--mesh {args.mesh!r}) must divide {what} "
                                 f"({size})")


def load_corpus() -> tuple[torch.Tensor, int]:
    """The bundled text as character ids, and a vocabulary size rounded up to a multiple of 16 (so that it
    splits over a model axis)."""
    text = resources.files("spmd.demo").joinpath("corpus.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), 16 * math.ceil(len(chars) / 16)


def batches(data: torch.Tensor, steps: int, batch_size: int, block_size: int, seed: int):
    """The same random windows for every run: (inputs, targets), each (B, T)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=gen)
        window = torch.stack([data[s: s + block_size + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def _devices(n: int, device: str) -> list[str]:
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA device")
        return [f"GPU:{i}" for i in range(n)]  # virtual devices beyond the GPU count share the GPU(s)
    return [f"CPU:{i}" for i in range(n)]


def train_spmd(model: GPT, mesh: spmd.Mesh, args: DemoArgs, data, console: Console | None = None):
    """Trains `model` (already distributed on `mesh`) and returns (losses, seconds, optimizer)."""
    dims = dict(zip(mesh.dim_names, mesh.shape()))
    batch_dim = "batch" if "batch" in dims else None
    data_layout = Layout([batch_dim or UNSHARDED, UNSHARDED], mesh)
    positions = spmd.copy_to_mesh(torch.arange(args.block_size), Layout([UNSHARDED], mesh))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, tokens = [], args.batch_size * args.block_size

    def train_step(x, y):
        loss = model(x, positions, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if args.compile or args.whole_step:  # without whole_step, backward and the optimizer step run between graphs,
        # as under torch.compile. aot_eager: the traced graphs run as plain aten kernels, no per-op Python.
        # (inductor miscompiles this model's AdamW graph when two parameters share a global shape but not a local
        # one: a known bug.)
        train_step = spmd.function(train_step, backend="aot_eager", fullgraph=False, whole_step=args.whole_step)
    progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]:.4f}  {task.fields[rate]:,.0f} tokens/s"),
                        TimeRemainingColumn(), console=console, transient=False, disable=console is None)
    torch.manual_seed(args.seed + 1)  # dropout draws its seeds from torch's generator: same stream every run
    start = time.perf_counter()
    with progress:
        task = progress.add_task("train", total=args.steps, loss=float("nan"), rate=0.0)
        for step, (x, y) in enumerate(batches(data, args.steps, args.batch_size, args.block_size, args.seed)):
            loss = train_step(spmd.copy_to_mesh(x, data_layout), spmd.copy_to_mesh(y, data_layout))
            losses.append(loss.item())
            rate = tokens * (step + 1) / (time.perf_counter() - start)
            progress.update(task, advance=1, loss=losses[-1], rate=rate)
    return losses, time.perf_counter() - start, opt


def train_plain(model: GPT, args: DemoArgs, data) -> tuple[list[float], float]:
    positions = torch.arange(args.block_size, device=next(model.parameters()).device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    torch.manual_seed(args.seed + 1)
    start = time.perf_counter()
    for x, y in batches(data, args.steps, args.batch_size, args.block_size, args.seed):
        loss = model(x.to(positions.device), positions, y.to(positions.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, time.perf_counter() - start


def _nbytes(t) -> int:
    """Bytes one device holds for `t` (a DTensor's component, or a plain tensor)."""
    local = t._local[0] if spmd.is_dtensor(t) else t
    return local.numel() * local.element_size()


def layout_table(model: GPT) -> Table:
    table = Table(title="parameter layouts")
    for column in ("parameter", "global shape", "layout", "per-device shape"):
        table.add_column(column)
    for name, p in model.named_parameters():
        layout = spmd.fetch_layout(p)
        table.add_row(name, str(tuple(p.shape)), str(layout.sharding_specs),
                      str(layout.local_shape_from_global_shape(tuple(p.shape))))
    return table


def memory_table(model: GPT, opt: torch.optim.Optimizer) -> Table:
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    rows = [("parameters", sum(_nbytes(p) for p in params), sum(p.numel() * p.element_size() for p in params)),
            ("gradients", sum(_nbytes(p) for p in params),
             sum(p.numel() * p.element_size() for p in params)),
            ("optimizer state", sum(_nbytes(v) for v in state), sum(v.numel() * v.element_size() for v in state))]
    table = Table(title="memory per device (every device holds the same amount)")
    for column in ("", "per device", "single device", "ratio"):
        table.add_column(column, justify="right")
    for name, per_device, single in rows:
        table.add_row(name, f"{per_device / 1024:,.1f} KiB", f"{single / 1024:,.1f} KiB",
                      f"{per_device / max(single, 1):.2f}")
    return table


def run(args: DemoArgs, console: Console | None = None) -> dict:
    """Runs the demo; returns the losses, timings and the parity result (for tests and benchmarks)."""
    console = console or Console()
    data, vocab = load_corpus()
    mesh_dims = parse_mesh(args.mesh)
    check_args(args, mesh_dims, vocab, len(data))
    n = math.prod(size for _, size in mesh_dims)
    if spmd.runtime.is_initialized() and spmd.num_clients() > 1:  # this client's share of the devices
        mesh = spmd.create_distributed_mesh(mesh_dims, local_devices=_devices(n // spmd.num_clients(), args.device))
    else:
        mesh = spmd.create_mesh(mesh_dims, devices=_devices(n, args.device))
    cfg = GPTConfig(vocab_size=vocab, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    d_model=args.d_model, dropout=args.dropout)
    torch.manual_seed(args.seed)
    reference = GPT(cfg)
    model = copy.deepcopy(reference)
    model_dim = "model" if "model" in dict(mesh_dims) else None
    spmd.distribute_module(model, mesh, spmd.LayoutMap(megatron_layouts(model_dim)),
                           shard_parameters="batch" if args.shard_parameters else None)
    console.print(f"GPT: {sum(p.numel() for p in reference.parameters()):,} parameters, {cfg.n_layer} layers, "
                  f"d_model {cfg.d_model}, {cfg.n_head} heads, vocabulary {vocab}; mesh {mesh_dims} on "
                  f"{mesh.torch_device}{_clients()}; global batch {args.batch_size} x {args.block_size} tokens")
    console.print(layout_table(model))
    losses, seconds, opt = train_spmd(model, mesh, args, data, console)
    console.print(memory_table(model, opt))
    result = {"losses": losses, "seconds": seconds,
              "tokens_per_s": args.batch_size * args.block_size * args.steps / seconds}
    if args.check:
        result.update(_check(reference, args, data, losses, console))
    return result


def _clients() -> str:
    n = spmd.num_clients() if spmd.runtime.is_initialized() else 1
    return f" ({n} clients x {spmd.num_local_devices(spmd.runtime._state().device_type)} devices)" if n > 1 else ""


def _check(reference: GPT, args: DemoArgs, data, losses: list[float], console: Console) -> dict:
    """The same model on a single device: plain torch without dropout, a 1-device mesh with dropout (spmd's
    random numbers are layout-invariant, torch's are not the same stream)."""
    if args.dropout == 0:
        single, seconds = train_plain(reference.to(args.device), args, data)
        what = "plain torch on one device"
    else:
        mesh = spmd.create_mesh([("batch", 1)], devices=_devices(1, args.device))
        model = spmd.distribute_module(reference, mesh)
        single, seconds, _ = train_spmd(model, mesh, args, data)
        what = "spmd on a 1-device mesh"
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, single))
    ok = worst < 1e-4
    table = Table(title=f"loss curve vs {what}")
    for column in ("step", "spmd", "single device"):
        table.add_column(column, justify="right")
    for step in sorted({0, len(losses) // 2, len(losses) - 1}):
        table.add_row(str(step), f"{losses[step]:.6f}", f"{single[step]:.6f}")
    console.print(table)
    mark = "[bold green]equal[/]" if ok else "[bold red]DIFFERENT[/]"
    console.print(f"loss curves {mark}: largest relative difference {worst:.2e} over {len(losses)} steps "
                  f"(single device: {args.batch_size * args.block_size * args.steps / seconds:,.0f} tokens/s)")
    return {"single_losses": single, "max_rel_diff": worst, "parity": ok}
