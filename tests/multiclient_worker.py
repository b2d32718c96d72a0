"""One client of a multi-client test run (started by tests/test_multiclient.py with torchrun's environment).

Usage: python multiclient_worker.py SCENARIO; the last stdout line is `RESULT <json>`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys


def _result(value) -> None:
    print("RESULT " + json.dumps(value), flush=True)


def docs_example():
    import torch
    import spmd
    from spmd import Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2)
    c = spmd.client_id()
    mesh = spmd.create_distributed_mesh([("x", 4)])
    t = spmd.pack([torch.tensor([2.0 * c]), torch.tensor([2.0 * c + 1])], Layout(["x"], mesh))
    replicated = spmd.relayout(t, Layout.replicated(mesh, 1))
    try:
        spmd.pack([torch.tensor([0.0])] * 4, Layout(["x"], mesh))
        pack_error = None
    except ValueError as e:
        pack_error = str(e)
    spmd.barrier(mesh)
    try:
        spmd.shutdown_accelerator_system()
        shutdown_error = None
    except ValueError as e:
        shutdown_error = str(e)
    _result({"client": c, "num_clients": spmd.num_clients(), "job": spmd.job_name(),
             "local_devices": spmd.local_devices("CPU"), "num_global": spmd.num_global_devices("CPU"),
             "mesh": mesh.to_string(), "local_ids": mesh.local_device_ids(), "shape": list(t.shape),
             "sum": t.sum().item(), "replicated": replicated.tolist(),
             "unpacked": [x.tolist() for x in spmd.unpack(t)], "global": spmd.to_global(t).tolist(),
             "pack_error": pack_error, "shutdown_error": shutdown_error, "fully_local": mesh.is_fully_local(),
             "torch_device": str(mesh.torch_device)})


def _meshes():
    # (dims, local devices per client): groups fully local, one member per client, two per client, and unequal
    # (the 3x2 mesh: a group over x holds 2 devices of client 0 and 1 of client 1); one device per client (the
    # torchrun case, the backend's direct path)
    return [([("x", 2), ("y", 2)], 2), ([("x", 4)], 2), ([("x", 4), ("y", 2)], 4), ([("x", 3), ("y", 2)], 3),
            ([("x", 2), ("y", 2), ("z", 2)], 4), ([("x", 2)], 1), ([("x", 2), ("y", 1)], 1)]


def collectives():
    import spmd
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2)
    checks, failures = 0, []
    for dims, per in _meshes():
        n, bad = _check_collectives(dims, per)
        checks += n
        failures += [f"{dims}: {f}" for f in bad]
    _result({"client": spmd.client_id(), "checks": checks, "failures": failures[:10]})


def _check_collectives(dims, per):
    """Every backend method and every relayout on `dims` (`per` devices per client) against one process."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    from spmd.collectives import InProcessCollectives, backend_for, p2p
    mesh = spmd.create_distributed_mesh(dims, local_devices=[f"CPU:{i}" for i in range(per)])
    ref_mesh = spmd.create_mesh(dims)  # the same mesh, all devices in this process
    comm, ref = backend_for(mesh), InProcessCollectives()
    mine = [i for i in mesh.local_device_ids()]
    names = mesh.dim_names
    checks, failures = 0, []

    def same(what, got, want, exact=True):
        nonlocal checks
        checks += 1
        equal = torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-12, atol=0)
        if got.shape != want.shape or not equal:
            failures.append(f"{what}: got {got.tolist()} want {want.tolist()}")

    # every backend method on raw stacked components (all devices of the mesh: values tell the device apart)
    local_shape = (6, 12)
    full = torch.arange(mesh.size * 72, dtype=torch.float64).reshape((mesh.size,) + local_shape) % 23 - 7
    x = full[mine]
    for r in range(1, len(names) + 1):
        for ds in itertools.combinations(names, r):
            for op in ("sum", "avg", "max", "min"):
                same(f"all_reduce{ds}{op}", comm.all_reduce(x, mesh, ds, op), ref.all_reduce(full, ref_mesh, ds, op)[mine])
    small = p2p.SMALL
    for d, p2p.SMALL in itertools.product(names, (small, 0)):  # 0: large components' point-to-point path
        k = mesh.dim_size(d)
        for op in ("sum", "avg", "max", "min"):
            same(f"all_reduce {d} {op} {p2p.SMALL}", comm.all_reduce(x, mesh, (d,), op),
                 ref.all_reduce(full, ref_mesh, (d,), op)[mine])
        for axis in (0, 1):
            same(f"all_gather {d} {axis}", comm.all_gather(x, mesh, d, axis), ref.all_gather(full, ref_mesh, d, axis)[mine])
            if local_shape[axis] % k == 0:
                same(f"shard {d} {axis}", comm.shard(x, mesh, d, axis), ref.shard(full, ref_mesh, d, axis)[mine])
                for op in ("sum", "max", "avg"):
                    same(f"reduce_scatter {d} {axis} {op} {p2p.SMALL}", comm.reduce_scatter(x, mesh, d, axis, op),
                         ref.reduce_scatter(full, ref_mesh, d, axis, op)[mine])
        for ga, sa in ((0, 1), (1, 0)):
            if local_shape[sa] % k == 0:
                same(f"all_to_all {d} {ga}->{sa} {p2p.SMALL}", comm.all_to_all(x, mesh, d, ga, sa),
                     ref.all_to_all(full, ref_mesh, d, ga, sa)[mine])
    p2p.SMALL = small
    xi = (full * 3).to(torch.int64)[mine]
    same("all_reduce int", comm.all_reduce(xi, mesh, (names[0],), "max"),
         ref.all_reduce((full * 3).to(torch.int64), ref_mesh, (names[0],), "max")[mine])
    xb = (full > 0)[mine]
    same("all_gather bool", comm.all_gather(xb, mesh, names[0], 0), ref.all_gather(full > 0, ref_mesh, names[0], 0)[mine])

    # relayout from every layout to every other, through the planner (values and components)
    shape = (12, 6)
    value = torch.arange(72, dtype=torch.float64).reshape(shape)
    specs = [U] + names
    layouts = [(a, b) for a in specs for b in specs if a == U or a != b]
    layouts = [(a, b) for a, b in layouts if shape[0] % (mesh.dim_size(a) if a != U else 1) == 0
               and shape[1] % (mesh.dim_size(b) if b != U else 1) == 0]
    for src in layouts:
        t = spmd.copy_to_mesh(value, Layout(list(src), mesh))
        for dst in layouts:
            got = spmd.relayout(t, Layout(list(dst), mesh))
            want = spmd.relayout(spmd.copy_to_mesh(value, Layout(list(src), ref_mesh)), Layout(list(dst), ref_mesh))
            same(f"relayout {src}->{dst}", got._local, want._local[mine])
            same(f"to_global {dst}", spmd.to_global(got), value)
    # onto another mesh of the same devices (one dim "u"), and back: each client receives only its target parts
    flat_dims = [("u", mesh.size)]
    flat = spmd.create_distributed_mesh(flat_dims, mesh_name="flat", local_devices=[f"CPU:{i}" for i in range(per)])
    ref_flat = spmd.create_mesh(flat_dims, mesh_name="flat")
    flat_layouts = [s for s in ([U, U], ["u", U], [U, "u"]) if all(n % (mesh.size if a == "u" else 1) == 0
                                                                    for n, a in zip(shape, s))]
    for src in layouts:
        t = spmd.copy_to_mesh(value, Layout(list(src), mesh))
        ref_t = spmd.copy_to_mesh(value, Layout(list(src), ref_mesh))
        for dst in flat_layouts:
            got = spmd.relayout(t, Layout(dst, flat))
            same(f"cross-mesh {src}->{dst}", got._local, spmd.relayout(ref_t, Layout(dst, ref_flat))._local[mine])
            same(f"cross-mesh back {dst}->{src}", spmd.relayout(got, Layout(list(src), mesh))._local, t._local)
    # an axis sharded over several mesh dims: permutes, and relayouts to and from every pair (in both orders)
    for ds in itertools.permutations(names, 2):
        same(f"permute {ds}", comm.permute(x, mesh, ds, ds[::-1]), ref.permute(full, ref_mesh, ds, ds[::-1])[mine])
    pairs = []
    if len(names) > 1:
        pairs = [p for p in itertools.permutations(names, 2) if 12 % (mesh.dim_size(p[0]) * mesh.dim_size(p[1])) == 0]
        multi = [(p, U) for p in pairs] + [(p, r) for p in pairs for r in names if r not in p and 6 % mesh.dim_size(r) == 0]
        for src in multi + layouts:
            t = spmd.copy_to_mesh(value, Layout(list(src), mesh))
            for dst in multi + (layouts if src in multi else multi):
                got = spmd.relayout(t, Layout(list(dst), mesh))
                want = spmd.relayout(spmd.copy_to_mesh(value, Layout(list(src), ref_mesh)), Layout(list(dst), ref_mesh))
                same(f"relayout {src}->{dst}", got._local, want._local[mine])
                same(f"to_global {dst}", spmd.to_global(got), value)
    for p in pairs[:1]:
        dv = spmd.copy_to_mesh(value, Layout([p, U], mesh))
        same(f"sum over {p}", spmd.to_global(dv.sum(0)), value.sum(0), exact=False)
        product = spmd.relayout(dv @ dv.t(), Layout([p, U], mesh))  # a pending sum reduce-scattered over p
        same(f"sum into {p}", spmd.to_global(product), value @ value.t(), exact=False)
    # a matmul with a sharded contraction (a pending sum across clients), a sum, a mean, a max
    a = torch.arange(48, dtype=torch.float64).reshape(4, 12) / 7
    b = torch.arange(36, dtype=torch.float64).reshape(12, 3) / 5
    for c in names:
        if 12 % mesh.dim_size(c) or 4 % mesh.dim_size(names[-1]):
            continue
        rows = names[-1] if names[-1] != c else U
        da = spmd.copy_to_mesh(a, Layout([rows, c], mesh))
        db = spmd.copy_to_mesh(b, Layout([c, U], mesh))
        prod = da @ db
        same(f"matmul contract {c}", spmd.to_global(prod), a @ b, exact=False)
        same(f"sum {c}", spmd.to_global(da.sum()), a.sum(), exact=False)
        same(f"max {c}", spmd.to_global(da.amax(dim=1)), a.amax(dim=1), exact=False)
        same(f"mean {c}", spmd.to_global(da.mean(dim=0)), a.mean(dim=0), exact=False)
    spmd.barrier(mesh)
    return checks, failures


def _mlp_losses(mesh, steps=4, backend=None):
    """A small MLP (DVariables, batch x model layouts, SGD with momentum) in float64; returns the losses.
    With `backend` the step runs under `spmd.function(backend=backend, fullgraph=False)`."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(16, 4, generator=gen, dtype=torch.float64)
    w1 = torch.randn(8, 12, generator=gen, dtype=torch.float64) / 3
    b1 = torch.randn(12, generator=gen, dtype=torch.float64) / 3
    w2 = torch.randn(12, 4, generator=gen, dtype=torch.float64) / 4
    params = [spmd.DVariable(w1, layout=Layout([U, "model"], mesh)), spmd.DVariable(b1, layout=Layout(["model"], mesh)),
              spmd.DVariable(w2, layout=Layout(["model", U], mesh))]
    dx = spmd.copy_to_mesh(x, Layout(["batch", U], mesh))
    dy = spmd.copy_to_mesh(y, Layout(["batch", U], mesh))
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def step(dx, dy):
        loss = ((torch.tanh(dx @ params[0] + params[1]) @ params[2] - dy) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if backend is not None:
        step = spmd.function(step, backend=backend, fullgraph=False)
    losses = [step(dx, dy).item() for _ in range(steps)]
    layouts = [spmd.fetch_layout(p).sharding_specs for p in params]
    return losses, layouts


def training():
    import spmd
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2)
    mesh = spmd.create_distributed_mesh([("batch", 2), ("model", 2)])
    losses, layouts = _mlp_losses(mesh)
    _result({"client": spmd.client_id(), "losses": losses, "layouts": layouts})


def grad_scaler():
    """GradScaler over a weight sharded between the clients, fused and foreach AdamW: an infinity in client 1's
    shard of the gradient makes every client skip the step and lower the scale; a finite step updates all."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    mesh = spmd.create_distributed_mesh([("x", 2)])
    out = {"client": spmd.client_id()}
    for mode in ("fused", "foreach"):
        w = spmd.DVariable(torch.ones(4, 2), layout=Layout(["x", U], mesh))
        opt = torch.optim.AdamW([w], lr=0.1, **{mode: True})
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        for bad in (True, False):
            g = torch.ones(4, 2)
            if bad:
                g[3, 0] = float("inf")  # in client 1's rows only
            scaler.scale((w * spmd.copy_to_mesh(g, Layout(["x", U], mesh))).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out[f"{mode} {'inf' if bad else 'finite'}"] = [scaler.get_scale(), spmd.to_global(w)[:, 1].tolist()]
    _result(out)


def comparisons():
    """torch.equal / torch.allclose of tensors sharded between the clients, differing in client 1's block only:
    every client answers for the whole tensors."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    mesh = spmd.create_distributed_mesh([("x", 2)])
    a = torch.arange(8.).reshape(4, 2)
    far, near = a.clone(), a.clone()
    far[3, 1], near[3, 1] = 100.0, 7.0 + 1e-5
    out = {"client": spmd.client_id()}
    rows, cols = Layout(["x", U], mesh), Layout([U, "x"], mesh)
    for name, other, layout in (("far", far, rows), ("near", near, rows), ("far cols", far, cols),
                                ("same", a, rows)):
        da, db = spmd.copy_to_mesh(a, rows), spmd.copy_to_mesh(other, layout)
        out[name] = [torch.equal(da, db), torch.allclose(da, db)]
    _result(out)


def value_shaped():
    """`x[mask]`, `nonzero`, `unique` of a tensor sharded between the clients: every client holds the whole result
    (and agrees on its shape); the gradient of `x[mask]` flows back to each client's block."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    mesh = spmd.create_distributed_mesh([("x", 2)])
    value = torch.tensor([[1., -2.], [-3., 4.], [5., 6.], [-7., -8.]])
    x = spmd.copy_to_mesh(value, Layout(["x", U], mesh)).requires_grad_()
    selected = x[x > 0]
    (selected * selected).sum().backward()
    _result({"client": spmd.client_id(), "selected": spmd.to_global(selected).tolist(),
             "nonzero": spmd.to_global(torch.nonzero(x.detach() < 0)).tolist(),
             "unique": [spmd.to_global(t).tolist() for t in torch.unique(x.detach().abs() > 4, return_counts=True)],
             "grad": [c.tolist() for c in spmd.unpack(x.grad)]})


def compiled_training():
    """The MLP's step compiled (argv: local devices per client, mesh dims as `batch,model`); reports the losses, and
    the torch.distributed collectives in the compiled forward and backward graphs (recorded with aot_eager)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import run_and_get_code
    import spmd
    per, (batch, model) = int(sys.argv[2]), map(int, sys.argv[3].split(","))
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=per)
    mesh = spmd.create_distributed_mesh([("batch", batch), ("model", model)])
    graphs = {"forward": [], "backward": []}

    def recording(kind):
        def compiler(gm, example_inputs):
            graphs[kind] += [str(n.target) for n in gm.graph.nodes if "_c10d_functional" in str(n.target)]
            return gm
        return compiler

    recorded, _ = _mlp_losses(mesh, backend=aot_autograd(fw_compiler=recording("forward"),
                                                         bw_compiler=recording("backward")))
    (inductor, layouts), codes = run_and_get_code(_mlp_losses, mesh, backend="inductor")
    # inductor's code: the all-reduces of each graph (the backward's merged into one bucket)
    calls = [n for n in (code.count("_c10d_functional.all_reduce") for code in codes) if n]
    _result({"client": spmd.client_id(), "aot_eager": recorded, "inductor": inductor, "layouts": layouts,
             "collectives": graphs, "inductor_all_reduces": calls})






def dtensor_env():
    import torch
    import spmd
    from spmd import Layout
    before = {"client": spmd.client_id(), "num_clients": spmd.num_clients(), "job": spmd.job_name(),
              "jobs": spmd.runtime.jobs(), "full_job_name": spmd.runtime.full_job_name()}
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    mesh = spmd.create_distributed_mesh([("x", 2)])
    t = spmd.pack([torch.tensor([float(spmd.client_id() + 1)])], Layout(["x"], mesh))
    _result({"before": before, "sum": t.sum().item(), "mesh": mesh.to_string(),
             "local_devices": spmd.local_devices("CPU")})


def dataset():
    """DTensorDataset on a multi-client mesh: each client reads only the rows its devices hold; a training step
    on the batches gives the one-process value."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2)
    mesh = spmd.create_distributed_mesh([("batch", 2), ("model", 2)])

    class Rows(torch.utils.data.Dataset):
        read = []

        def __len__(self):
            return 32

        def __getitem__(self, i):
            self.read.append(i)
            return torch.full((3,), float(i)), torch.tensor(i % 5)

    data = Rows()
    ds = spmd.DTensorDataset(data, mesh=mesh, layouts=(Layout(["batch", U], mesh), Layout(["batch"], mesh)),
                             global_batch_size=8, batch_dim="batch")
    sums, components = [], []
    for x, y in ds:
        components.append([c[:, 0].tolist() for c in spmd.unpack(x)])
        sums.append((x.sum() + y.sum()).item())
    _result({"client": spmd.client_id(), "read": sorted(data.read), "sums": sums, "components": components[0]})


def multi_mesh():
    """The RFC's distributed embedding (tests/test_multi_mesh.py) with both meshes spread over the clients."""
    import torch
    import torch.nn.functional as F
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2)
    compute = spmd.create_distributed_mesh([("batch", 2), ("model", 2)])
    embedding = spmd.create_distributed_mesh([("e", 2)], mesh_name="embedding", local_devices=["CPU:2"])
    torch.manual_seed(0)
    table_value, proj_value = torch.randn(16, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    ids = torch.randint(0, 16, (4, 5))
    table = spmd.DVariable(table_value, layout=Layout([U, "e"], embedding))
    proj = spmd.DVariable(proj_value, layout=Layout([U, "model"], compute))
    batch = spmd.copy_to_mesh(ids, Layout(["batch", U], compute))
    like = spmd.zeros((4, 5, 6), dtype=torch.float64, layout=Layout(["batch", U, U], compute))
    looked_up = F.embedding(spmd.relayout(batch, Layout([U, U], embedding)), table)
    loss = (spmd.relayout_like(looked_up, like) @ proj).square().sum()
    loss.backward()
    ref_table, ref_proj = table_value.clone().requires_grad_(), proj_value.clone().requires_grad_()
    ref_loss = (F.embedding(ids, ref_table) @ ref_proj).square().sum()
    ref_loss.backward()
    _result({"loss": loss.item(), "ref_loss": ref_loss.item(),
             "table_grad": (spmd.to_global(table.grad) - ref_table.grad).abs().max().item(),
             "proj_grad": (spmd.to_global(proj.grad) - ref_proj.grad).abs().max().item(),
             "grad_layout": spmd.fetch_layout(table.grad).sharding_specs})


class _CountedCalls:
    """Records (call, elements sent) of each torch.distributed collective spmd's collectives make."""
    CALLS = ("all_reduce", "all_gather", "all_to_all_single", "isend", "broadcast")

    def __enter__(self):
        import spmd.collectives.assembly as assembly
        import spmd.collectives.distributed as distributed
        import spmd.collectives.groups as groups
        import spmd.collectives.p2p as p2p
        self.modules, self.calls = (assembly, distributed, groups, p2p), []
        real = distributed.dist
        calls = self.calls

        class Proxy:
            def __getattr__(self, name):
                fn = getattr(real, name)
                if name not in _CountedCalls.CALLS:
                    return fn

                def counted(*args, **kwargs):
                    sent = args[1] if name in ("all_gather", "all_to_all_single") else args[0]
                    calls.append((name, sent.numel()))
                    return fn(*args, **kwargs)
                return counted
        for m in self.modules:
            m.dist = Proxy()
        self.real = real
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.dist = self.real


def traffic():
    """The torch.distributed calls (and elements sent) of to_global and of relayouts onto another mesh on a
    batch x model mesh of 2 clients x 2 devices: only what a client lacks is sent."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2)
    mesh = spmd.create_distributed_mesh([("batch", 2), ("model", 2)])
    other = spmd.create_distributed_mesh([("e", 4)], mesh_name="other")
    value = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    calls, ok = {}, {}
    for name, layout in (("R", [U, U]), ("S_batch", ["batch", U]), ("S_model", ["model", U]),
                         ("S_batch_model", ["batch", "model"])):
        t = spmd.copy_to_mesh(value, Layout(layout, mesh))
        with _CountedCalls() as c:
            got = spmd.to_global(t)
        calls[f"to_global {name}"], ok[f"to_global {name}"] = c.calls, torch.equal(got, value)
    for name, src, dst in (("rows to rows", ["batch", U], ["e", U]), ("rows to columns", ["batch", U], [U, "e"]),
                           ("replicated to columns", [U, U], [U, "e"])):
        t = spmd.copy_to_mesh(value, Layout(src, mesh))
        with _CountedCalls() as c:
            got = spmd.relayout(t, Layout(dst, other))
        want = spmd.unpack(spmd.copy_to_mesh(value, Layout(dst, other)))
        calls[name] = c.calls
        ok[name] = all(torch.equal(a, b) for a, b in zip(spmd.unpack(got), want))
    spmd.barrier(mesh)
    _result({"calls": calls, "ok": ok})


class _CountAllReduce:
    """Counts `torch.distributed.all_reduce` calls (spmd's collectives call it through the module)."""

    def __enter__(self):
        import torch.distributed as dist
        self.calls, self._real = [], dist.all_reduce

        def counted(*args, **kwargs):
            self.calls.append(bool(kwargs.get("async_op")))
            return self._real(*args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.all_reduce = self._real


def _dp_training(mesh, bucket_cap_mb=None, steps=3, micro_batches=1):
    """A 3-layer MLP (float64) made by `distribute_module`, trained data parallel with SGD + momentum; returns the
    losses, the final parameters, and per step the all_reduce calls of backward + optimizer step (True: async).
    With `micro_batches` > 1 each step accumulates the micro-batches' gradients under `spmd.no_sync` but the last."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4)).double()
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    spmd.distribute_module(model, mesh, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = Layout(["batch", U], mesh)
    chunks = [(spmd.copy_to_mesh(a, data), spmd.copy_to_mesh(b, data))
              for a, b in zip(x.chunk(micro_batches), y.chunk(micro_batches))]
    losses, calls = [], []
    for _ in range(steps):
        with _CountAllReduce() as counted:
            for i, (dx, dy) in enumerate(chunks):
                sync = spmd.no_sync(model) if i < len(chunks) - 1 else contextlib.nullcontext()
                with sync:
                    loss = ((model(dx) - dy) ** 2).mean() / micro_batches
                    loss.backward()
            opt.step()
            opt.zero_grad()
        calls.append(counted.calls)
        losses.append(loss.item())
    return losses, [spmd.to_global(p.detach()).tolist() for p in model.parameters()], calls


def bucketed_training():
    """`_dp_training` with bucket sizes (argv: local devices per client, mesh dims as `batch,model`), and
    accumulation over 2 micro-batches with no_sync."""
    import spmd
    per, (batch, model) = int(sys.argv[2]), map(int, sys.argv[3].split(","))
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=per)
    mesh = spmd.create_distributed_mesh([("batch", batch), ("model", model)])
    out = {"client": spmd.client_id()}
    for cap in (0, 1e-6, 25):  # off; one gradient per bucket; everything in one bucket
        out[str(cap)] = _dp_training(mesh, cap)
    out["no_sync"] = _dp_training(mesh, micro_batches=2)
    _result(out)


def bucket_buffers():
    """Four SGD steps of a small MLP, each backward one bucket: the buffers the buckets were summed in (kept, so
    that a new buffer cannot land where an old one was), and whether the gradients the user kept after step 2 still
    hold their values after steps 3 and 4."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    from spmd.collectives.distributed import DistributedCollectives
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    mesh = spmd.create_distributed_mesh([("batch", 2)])
    buffers, sum_async = [], DistributedCollectives.sum_async

    def recording(self, buf, *args):
        buffers.append(buf)
        return sum_async(self, buf, *args)
    DistributedCollectives.sum_async = recording
    torch.manual_seed(0)
    model = spmd.distribute_module(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)),
                                   mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = spmd.copy_to_mesh(torch.randn(16, 8), Layout(["batch", U], mesh))
    for step in range(4):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step == 1:
            kept = [p.grad for p in model.parameters()]
            values = [spmd.to_global(g).clone() for g in kept]
    _result({"buffers": [b.data_ptr() for b in buffers],
             "kept_unchanged": all(torch.equal(spmd.to_global(g), v) for g, v in zip(kept, values))})


def donated_all_reduce():
    """A pending sum resolved by the op that reads it: all-reduced in its own memory when nothing else holds that
    memory, into a copy when something does (the holder keeps the partial sums)."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    mesh = spmd.create_distributed_mesh([("x", 2)])
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 8, generator=gen), torch.randn(8, 4, generator=gen)
    da, db = spmd.copy_to_mesh(a, Layout([U, "x"], mesh)), spmd.copy_to_mesh(b, Layout(["x", U], mesh))
    alone = da @ db  # each client's partial product, pending over x
    memory = alone._stack.data_ptr()
    relu = torch.relu(alone)
    held = da @ db
    holder, partial = held._stack, held._stack.clone()
    torch.relu(held)
    # a 3-D input's product, viewed back by torch (`_unsafe_view`), and with a bias (`view` of the product, read
    # through it): each still reduced in the memory it was computed in
    rows, bias = torch.randn(2, 4, 8, generator=gen), torch.randn(4, generator=gen)
    drows, dbias = spmd.copy_to_mesh(rows, Layout([U, U, "x"], mesh)), spmd.copy_to_mesh(bias, Layout([U], mesh))
    folded, biased = drows @ db, torch.nn.functional.linear(drows, db.t(), dbias)
    memories = [t._stack.data_ptr() for t in (folded, biased)]
    folded_relu, biased_relu = torch.relu(folded), torch.relu(biased)
    _result({"client": spmd.client_id(), "in_place": alone._stack.data_ptr() == memory,
             "views_in_place": [t._stack.data_ptr() for t in (folded, biased)] == memories,
             "views_values": [torch.allclose(spmd.to_global(t), r, atol=1e-6) for t, r in (
                 (folded_relu, torch.relu(rows @ b)), (biased_relu, torch.relu(rows @ b + bias)))],
             "holder_kept": torch.equal(holder, partial) and held._stack.data_ptr() != holder.data_ptr(),
             "values": [torch.allclose(spmd.to_global(t), r, atol=1e-6)
                        for t, r in ((alone, a @ b), (relu, torch.relu(a @ b)), (held, a @ b))]})


def _mlp_and_data(dtype):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4)).to(dtype)
    return model, torch.randn(16, 8, dtype=dtype), torch.randn(16, 4, dtype=dtype)


def _mixed_precision():
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _fsdp_training(mesh, steps=3, tensor_parallel=False, mixed_precision=False, accumulate=False):
    """A 3-layer MLP (float64; float32 with bfloat16 compute under `mixed_precision`) with parameters sharded over
    "batch" (`shard_parameters`), optionally tensor parallel over "model" too, trained with AdamW on batch-sharded
    data; returns the losses, the final parameters and the parameters' layouts. With `accumulate`, each step is two
    micro-batches of the same rows, each with half the loss, the first inside `spmd.no_sync`: the same gradients."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    model, x, y = _mlp_and_data(torch.float32 if mixed_precision else torch.float64)
    tp = {r"0\.weight": ["model", U], r"0\.bias": ["model"], r"2\.weight": [U, "model"]} if tensor_parallel else None
    spmd.distribute_module(model, mesh, tp, shard_parameters="batch",
                           mp_policy=_mixed_precision() if mixed_precision else None)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = Layout(["batch", U], mesh)
    dx, dy = spmd.copy_to_mesh(x, data), spmd.copy_to_mesh(y, data)
    losses, prefetched = [], {False: 0, True: 0}
    start_gather = spmd.fsdp._start_gather

    def counted(*args):  # the gathers started ahead of their unit's forward (or, in backward, of its backward)
        handle = start_gather(*args)
        prefetched[torch._C._current_autograd_node() is not None] += handle is not None
        return handle
    spmd.fsdp._start_gather = counted
    try:
        for _ in range(steps):
            with spmd.explain.Recorder() as record:
                if accumulate:
                    with spmd.no_sync(model):
                        (((model(dx).float() - dy) ** 2).mean() / 2).backward()
                loss = ((model(dx).float() - dy) ** 2).mean()
                (loss / 2 if accumulate else loss).backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        spmd.fsdp._start_gather = start_gather
    backward_gathers = sum(c.kind == "all_gather" for c in record.collectives if c.backward)  # (the last step's)
    return (losses, [spmd.to_global(p.detach()).tolist() for p in model.parameters()],
            [p._layout.sharding_specs for p in model.parameters()], prefetched[False], prefetched[True],
            backward_gathers)


def _fsdp2_mixed_precision(steps=3):
    """`_fsdp_training(mixed_precision=True)` with torch's FSDP2 (`fully_shard` per layer and at the root, one device
    per process): the losses."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    model, x, y = _mlp_and_data(torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=_mixed_precision())
    fully_shard(model, mp_policy=_mixed_precision())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rows = slice(dist.get_rank() * 16 // dist.get_world_size(), (dist.get_rank() + 1) * 16 // dist.get_world_size())
    losses = []
    for _ in range(steps):
        loss = ((model(x[rows]).float() - y[rows]) ** 2).mean()  # FSDP2 averages the gradients over the ranks
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def fsdp_training():
    """`_fsdp_training` (argv: local devices per client, mesh dims as `batch,model`), data parallel and 2-D."""
    import spmd
    per, (batch, model) = int(sys.argv[2]), map(int, sys.argv[3].split(","))
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=per)
    mesh = spmd.create_distributed_mesh([("batch", batch), ("model", model)])
    result = {"client": spmd.client_id(), "dp": _fsdp_training(mesh), "2d": _fsdp_training(mesh, tensor_parallel=True),
              "accumulated": _fsdp_training(mesh, accumulate=True)}
    if per == 1 and model == 1:  # one device per process: torch's FSDP2 runs the same mixed-precision training
        # (the losses only: a client's RESULT line must fit the pipe, or it blocks until the others exit)
        result.update(mixed=_fsdp_training(mesh, mixed_precision=True)[0], fsdp2_mixed=_fsdp2_mixed_precision())
    _result(result)








if __name__ == "__main__":
    globals()[sys.argv[1]]()
