"""One client of a 2-process run converting between spmd's DTensor and torch's (tests/test_torch_dtensor_interop.py).

Usage: python torch_dtensor_worker.py; the last stdout line is `RESULT <json>`. Every value the test checks is
recorded as lists, placements as strings.
"""

from __future__ import annotations

import json


def _to_torch_cases(results: dict) -> None:
    """spmd -> torch: Shard, Replicate, and each pending reduction as a Partial."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    from spmd.interop import to_torch_dtensor
    mesh = spmd.create_distributed_mesh([("x", 2)])
    x = torch.arange(8.0).reshape(4, 2)
    cases = {"shard": spmd.copy_to_mesh(x, Layout(["x", U], mesh)),
             "replicate": spmd.copy_to_mesh(x, Layout.replicated(mesh, 2))}
    sharded = cases["shard"]
    cases.update({"sum": sharded.T @ sharded, "avg": sharded.mean(0), "max": sharded.amax(0),
                  "min": sharded.amin(0)})
    for name, t in cases.items():
        stack = t._stack  # the unresolved components: a Partial shares them
        d = to_torch_dtensor(t)
        results[name] = {"placements": [str(p) for p in d.placements], "pending": [list(t._pending), t._pending_op],
                         "shares": d.to_local().data_ptr() == stack[0].data_ptr(), "local": d.to_local().tolist(),
                         "full": d.full_tensor().tolist(), "spmd": spmd.to_global(t).tolist()}
    d = to_torch_dtensor(sharded)
    results["torch_matmul"] = (d.T @ d).full_tensor().tolist()
    results["spmd_matmul"] = spmd.to_global(sharded.T @ sharded).tolist()
    results["same_device_mesh"] = to_torch_dtensor(sharded).device_mesh is d.device_mesh


def _to_torch_2d(results: dict) -> None:
    """A 2x1 mesh: a DeviceMesh of two dims, the tensor's axes sharded in the other order."""
    import torch
    import spmd
    from spmd import Layout
    from spmd.interop import from_torch_dtensor, to_torch_dtensor
    mesh = spmd.create_distributed_mesh([("x", 2), ("y", 1)])
    x = torch.arange(12.0).reshape(2, 6)
    t = spmd.copy_to_mesh(x, Layout(["y", "x"], mesh))
    d = to_torch_dtensor(t)
    back = from_torch_dtensor(d)
    results["2d"] = {"placements": [str(p) for p in d.placements], "dims": list(d.device_mesh.mesh_dim_names),
                     "local": d.to_local().tolist(), "full": d.full_tensor().tolist(),
                     "back_layout": back._layout == t._layout,
                     "back_shares": back._stack.data_ptr() == t._stack.data_ptr()}


def _from_torch_cases(results: dict) -> None:
    """torch -> spmd: Shard, Replicate and each Partial reduction; the spmd mesh is made for the DeviceMesh."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    import spmd
    from spmd.interop import from_torch_dtensor
    rank = torch.distributed.get_rank()
    dm = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    x = torch.arange(8.0).reshape(2, 4)
    torch_tensors = {"shard1": distribute_tensor(x, dm, [Shard(1)]),
                     "replicate": distribute_tensor(x, dm, [Replicate()])}
    for op in ("sum", "avg", "max", "min"):
        torch_tensors[f"partial_{op}"] = DTensor.from_local(torch.tensor([rank + 1.0, 10.0 * (rank + 1)]), dm,
                                                            [Partial(op)])
    for name, td in torch_tensors.items():
        t = from_torch_dtensor(td)
        entry = {"mesh": t._layout.mesh == spmd.create_distributed_mesh([("x", 2)]),
                 "specs": t._layout.sharding_specs, "pending": [list(t._pending), t._pending_op],
                 "shares": t._stack.data_ptr() == td.to_local().data_ptr(), "local": t._stack.tolist()}
        entry["global"] = spmd.to_global(t).tolist()  # resolves a pending reduction
        entry["torch_full"] = td.full_tensor().tolist()
        results[f"from_{name}"] = entry
    try:
        from_torch_dtensor(distribute_tensor(torch.arange(3.0), dm, [Shard(0)]))
        results["uneven"] = None
    except spmd.IndivisibleError as e:
        results["uneven"] = str(e)


def main() -> None:
    import spmd
    spmd.initialize_accelerator_system("CPU")
    results = {"client": spmd.client_id()}
    _to_torch_cases(results)
    _to_torch_2d(results)
    _from_torch_cases(results)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
