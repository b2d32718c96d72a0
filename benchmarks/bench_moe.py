"""A mixture-of-experts model trained data parallel on 2 clients (gloo on 127.0.0.1, 1 thread each): HuggingFace's
Mixtral, unchanged, with its experts as one grouped product (`experts_implementation="grouped_mm"`).

Variants, each a training step with AdamW on the same batches (each client its half):
- `ddp`: `DistributedDataParallel` on each client's half of the batch;
- `spmd`: `distribute_module`, the batch sharded: spmd runs the model's global routing as written (the tokens of the
  whole batch sorted by expert), so each MoE layer gathers every client's tokens and each client runs the experts
  over all of them;
- `spmd_local`: the same, with each layer's experts under `spmd.local_map`: each client routes its own tokens;
- `spmd_local_fn`: that step under `spmd.function` (inductor; the optimizer's update a graph of its own);
- `spmd_ep`: expert parallel (`spmd.expert_parallel`): each client holds half of the experts, and each layer sends
  the tokens to their experts' client and back by all-to-all (no token dropped); the experts' gradients stay where
  they are, so only the other parameters' gradients are all-reduced;
- `spmd_ep_fn`: that step under `spmd.function`.

Reported: ms per step, its ratio to DDP's, the parameters a client holds (AdamW keeps two more of each), the
all-gathers and all-to-alls of one eager spmd step (the gradients' all-reduces are bucketed as DDP's in every
variant), the largest difference of the first steps' losses to DDP's.

usage: python benchmarks/bench_moe.py [--quick] [--reps R] [--steps N] [--out DIR]
       python benchmarks/bench_moe.py --readme-only   # README.md's table from results/moe.json
The script launches its own 2 worker processes (hard timeout); client 0 reports. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks._common import (environment, fmt, launch_clients, md_table, output_arguments, ratio, time_cases,
                                update_readme, write_results)

MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, num_local_experts=8, num_experts_per_tok=2)
QUICK_MODEL = dict(MODEL, hidden_size=32, intermediate_size=64, num_local_experts=4, vocab_size=64)
BATCH, QUICK_BATCH = (8, 64), (4, 8)  # (sequences, tokens each) of the global batch
VARIANTS = {"ddp": "DistributedDataParallel", "spmd": "spmd, the model's global routing",
            "spmd_local": "spmd, experts under `local_map` (each client routes its own tokens)",
            "spmd_local_fn": "the same under `spmd.function` (inductor)",
            "spmd_ep": "spmd, expert parallel (`expert_parallel`: half the experts per client, tokens by all-to-all)",
            "spmd_ep_fn": "the same under `spmd.function` (inductor)"}


# -- the worker (one per client) -------------------------------------------------------------------------------------
def _mixtral(config: dict):
    import transformers
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        max_position_embeddings=128, experts_implementation="grouped_mm", **config))


def _variants(args, rank: int):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import spmd
    from spmd import UNSHARDED as U, Layout
    mesh = spmd.create_distributed_mesh([("batch", 2)])
    base = _mixtral(QUICK_MODEL if args.quick else MODEL)
    rows, tokens = QUICK_BATCH if args.quick else BATCH
    ids = torch.randint(0, base.config.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(1))
    half = ids.chunk(2)[rank]
    sharded = spmd.copy_to_mesh(ids, Layout(["batch", U], mesh))
    variants = {"ddp": (DDP(copy.deepcopy(base)), half)}
    for name in ("spmd", "spmd_local", "spmd_local_fn", "spmd_ep", "spmd_ep_fn"):
        expert_parallel = name.startswith("spmd_ep")
        model = spmd.distribute_module(copy.deepcopy(base), mesh, {r"experts\.": ["batch", U, U]} if expert_parallel
                                       else None)
        for layer in model.model.layers if name != "spmd" else ():
            if expert_parallel:
                spmd.expert_parallel(layer.mlp.experts, "batch")
            else:
                layer.mlp.experts.forward = spmd.local_map(layer.mlp.experts, out_layouts=Layout(["batch", U], mesh))
        variants[name] = (model, sharded)
    losses = {name: [] for name in variants}

    def step_fn(name):
        model, batch = variants[name]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def body(batch):
            opt.zero_grad()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            return loss
        if name.endswith("_fn"):  # a forward+backward graph and an optimizer graph, as bench_multiclient's
            body = spmd.function(body, backend="aot_eager" if args.quick else "inductor", fullgraph=False)

        def step():
            loss = body(batch)
            if isinstance(loss, spmd.DTensor):
                losses[name].append(float(loss.item()))
            else:  # DDP: each client's loss is the mean over its half of the batch
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses[name].append(float(total) / 2)
        return step
    held = {name: sum(spmd.unpack(p)[0].numel() if isinstance(p, spmd.DTensor) else p.numel()
                      for p in model.parameters()) for name, (model, _) in variants.items()}
    return {name: step_fn(name) for name in variants}, losses, held


def worker(args) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # transformers' and spmd's one-time notes
    import torch.distributed as dist
    import spmd
    from spmd.explain import Recorder
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    rank = spmd.client_id()
    steps, losses, held = _variants(args, rank)
    for step in steps.values():  # warm-up: the first steps' losses, compared below
        for _ in range(args.warm):
            step()
    first = {name: list(values) for name, values in losses.items()}
    collectives = {}
    for name in ("spmd", "spmd_local", "spmd_ep"):  # (a graph's collectives are recorded when it is traced, not run)
        with Recorder() as r:
            steps[name]()
        counts: dict[str, int] = {}
        for c in r.collectives:
            counts[c.kind] = counts.get(c.kind, 0) + 1
        collectives[name] = counts
    results = time_cases(steps, args.steps, args.reps, warm=1)
    for r in results.values():
        if "median" in r:
            r["median"] /= 1000  # ms per step
    data = {"environment": environment(), "quick": args.quick, "parameters_per_client": held,
            "model": QUICK_MODEL if args.quick else MODEL,
            "batch": QUICK_BATCH if args.quick else BATCH, "results": results, "collectives": collectives,
            "max_loss_diff_vs_ddp": {name: max(abs(a - b) for a, b in zip(first[name], first["ddp"]))
                                     for name in first}}
    dist.barrier()
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(data, f, default=str)


# -- the launcher and the report -------------------------------------------------------------------------------------
def caption(data: dict) -> str:
    m, (rows, tokens) = data["model"], data["batch"]
    return (f"HuggingFace Mixtral, {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, {m['num_local_experts']}"
            f" experts of {m['intermediate_size']} (top {m['num_experts_per_tok']}), grouped products; global batch "
            f"{rows} × {tokens} tokens, AdamW; {data['environment']}; 2 clients on 127.0.0.1, gloo, 1 thread each. "
            "Medians over the repetitions (round-robin).")


def readme_table(data: dict) -> str:
    res, counts = data["results"], data["collectives"]
    ddp = res["ddp"].get("median")
    rows = []
    for name, label in VARIANTS.items():
        ms = res[name].get("median")
        gathers, exchanges = (str(counts[name].get(kind, 0)) if name in counts else "–"
                              for kind in ("all_gather", "all_to_all"))
        rows.append([label, fmt(ms), ratio(ms, ddp), f"{data['parameters_per_client'][name] / 1e6:.2f}", gathers,
                     exchanges, f"{data['max_loss_diff_vs_ddp'][name]:.1e}"])
    return caption(data) + "\n\n" + md_table(
        ["training step", "ms/step", "vs DDP", "parameters per client (M)", "all-gathers per step",
         "all-to-alls per step", "loss vs DDP"], rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model and few steps")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="training steps per repetition")
    p.add_argument("--warm", type=int, default=None, help="warm-up steps (their losses are compared)")
    p.add_argument("--timeout", type=float, default=None, help="hard limit for the 2 clients, seconds")
    output_arguments(p, "moe")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.readme_only:
        return update_readme("moe", readme_table, args.out)
    args.reps = args.reps or (1 if args.quick else 5)
    args.steps = args.steps or (1 if args.quick else 5)
    args.warm = args.warm or (2 if args.quick else 3)
    if args.worker_out:
        worker(args)
        return {}
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a]
    data = launch_clients(__file__, passthrough, 2, args.timeout or (90 if args.quick else 580))
    markdown = readme_table(data)
    write_results("moe", markdown, data, args.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
