"""A worker of a single-controller job: one multi-client spmd process that executes the controller's instructions.

On start it joins the other workers exactly as a multi-client program does (`initialize_accelerator_system`
with torchrun's variables), so collectives run worker to worker over `torch.distributed`. It keeps a table
handle -> DTensor (and the datasets the controller sent, with their iterators: spmd/controller/datasets.py) and
runs the instructions in the order they arrive; a checkpoint is its own multi-client `spmd.checkpoint` call. The
first failure is kept and reported at the next `call` (the controller's next read), naming the op; instructions
after it are skipped, since their inputs may be missing.
"""

from __future__ import annotations

import importlib
import os
import pickle
import traceback

import torch

from spmd import api, checkpoint, data, function_mode, runtime
from spmd.controller import protocol, traced
from spmd.dtensor import DTensor, make
from spmd.engine import dispatch


class WorkerState:
    """What one worker process holds; the engines' actors forward their messages to it."""

    def __init__(self, rank: int, num_workers: int, devices_per_worker: int, device_type: str, master_port: int,
                 collective_timeout: float, master_addr: str = "127.0.0.1", imports: tuple = ()):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(num_workers), LOCAL_RANK=str(rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_workers))
        runtime.initialize_accelerator_system(device_type, num_logical_cpu_devices=devices_per_worker,
                                              collective_timeout=collective_timeout)
        for name in imports:  # the user's modules the instructions need: custom ops and their sharding rules
            importlib.import_module(name)
        self.rank = rank
        self.table: dict[int, DTensor] = {}
        self.objects: dict[int, object] = {}  # datasets and their iterators, by id (ids shared with the table's)
        self.meshes: dict = {}
        self.device = None
        self.error: str | None = None

    # -- fire-and-forget instructions -----------------------------------------------------------------------------
    def run(self, payload: bytes) -> None:
        freed, instructions = pickle.loads(payload)
        if self.error is None:
            self._run(instructions)
        for h in freed:  # after: the controller may drop a tensor that an instruction of this message made or used
            self.table.pop(h, None)
            self.objects.pop(h, None)

    def _run(self, instructions) -> None:
        for instruction in instructions:
            try:
                _RUN[instruction[0]](self, *instruction[1:])
            except Exception as e:  # noqa: BLE001 - kept for the controller's next read
                self.error = _describe(instruction, e)
                return

    def _op(self, name, args, kwargs, out_handles) -> None:
        func = protocol.resolve_op(name)
        args = protocol.decode(args, self.table, self.meshes, self.device)
        kwargs = protocol.decode(kwargs, self.table, self.meshes, self.device)
        out = dispatch.dispatch(func, args, kwargs)
        if out_handles:
            for h, t in zip(out_handles, _dtensors(out)):
                if h is not None:
                    self.table[h] = t

    def _put(self, handle, layout_ref, value, is_global) -> None:
        layout = protocol.decode(layout_ref, self.table, self.meshes, self.device)
        if is_global:  # a replicated value: each local device keeps a copy
            self.table[handle] = api.copy_to_mesh(value, layout)
        else:  # this worker's rows of the stacked components
            self.table[handle] = make(value.to(self.device), layout)

    def _mesh(self, mesh_id, dims, name) -> None:
        mesh = runtime.create_distributed_mesh(dims, name)
        self.meshes[mesh_id] = mesh
        self.device = mesh.torch_device

    # -- function mode (spmd/controller/traced.py) -----------------------------------------------------------------
    def _graph(self, graph_id, payload, meshes, options) -> None:
        """Compiles a graph the controller traced, as this process's own multi-client `spmd.function`."""
        gm = pickle.loads(payload)
        ours = {name: self.meshes[mesh_id].to_string() for name, mesh_id in meshes.items()}
        for node in gm.graph.nodes:  # layout strings name the controller's meshes: this worker's instead
            node.args = tuple(_rename_meshes(a, ours) for a in node.args)
        gm.recompile()

        def graph(*args):  # (spmd.function wraps functions: a module has no __name__ or code of its own)
            return gm(*args)

        self.objects[graph_id] = function_mode.function(graph, fullgraph=True, **options)

    def _run_graph(self, graph_id, args, out_handles, call_id, needs_grad) -> None:
        compiled = self.objects[graph_id]
        args = protocol.decode(args, self.table, self.meshes, self.device)
        if call_id is None:
            with torch.no_grad():
                outs = compiled(*args)
        else:  # the controller's autograd calls `_graph_backward` with this call's state
            args = [a.detach().requires_grad_() if need else a for a, need in zip(args, needs_grad)]
            with torch.enable_grad():
                outs = compiled(*args)
            self.objects[call_id] = (outs, [a for a, need in zip(args, needs_grad) if need])
        self.table.update((h, o) for h, o in zip(out_handles, outs) if h is not None)

    def _graph_backward(self, call_id, grads, grad_handles) -> None:
        outs, inputs = self.objects.pop(call_id)
        grads = protocol.decode(grads, self.table, self.meshes, self.device)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
        self.table.update((h, g) for h, g in zip(grad_handles, got) if g is not None)

    def _graph_results(self, handles) -> list:
        ids = {mesh.to_string(): mesh_id for mesh_id, mesh in self.meshes.items()}
        return traced.results_metadata(self.table, handles, ids)

    def _iter(self, dataset_id, iterator_id) -> None:
        self.objects[iterator_id] = iter(self.objects[dataset_id])

    def _batch(self, iterator_id, out_handles) -> None:
        try:
            batch = next(self.objects[iterator_id])
        except StopIteration:
            raise RuntimeError("the dataset ended before len(dataset) batches: its length is not what it "
                               "gives") from None
        self._keep_batch(batch, out_handles)

    def _keep_batch(self, batch, out_handles) -> None:
        leaves = [leaf for _, leaf in data._flatten(batch, lambda v: False)[0]]
        self.table.update(zip(out_handles, leaves))

    # -- calls with a result ------------------------------------------------------------------------------------
    def call(self, payload: bytes):
        """Runs a read after the pending instructions; returns ("ok", value) or ("error", message)."""
        if self.error is not None:
            error, self.error = self.error, None
            return "error", error
        name, args = pickle.loads(payload)
        try:
            return "ok", _CALLS[name](self, *protocol.decode(args, self.table, self.meshes, self.device))
        except Exception as e:  # noqa: BLE001 - sent to the controller
            return "error", _describe((protocol.CALL, name), e)

    def _stack(self, t: DTensor) -> torch.Tensor:
        return t._local.detach().cpu()

    def _shapes(self, handles) -> list:
        """The global shapes and dtypes of these DTensors (the results of an op shaped by the values)."""
        return [(tuple(self.table[h].shape), self.table[h].dtype) for h in handles]

    def _item(self, name, args, kwargs):
        return dispatch.dispatch(protocol.resolve_op(name), args, kwargs)

    def _dataset(self, dataset_id, payload, layouts, options) -> tuple:
        """Builds this worker's DTensorDataset (its devices' rows only); returns what it found of the elements."""
        dataset, structure = pickle.loads(payload)
        ds = data.DTensorDataset(dataset, mesh=layouts[0].mesh, layouts=data._unflatten(structure, iter(layouts)),
                                 global_batch_size=None, **options)
        self.objects[dataset_id] = ds
        return ds._row_shapes, ds._dtypes, ds._elements_per_batch

    def _next_batch(self, iterator_id, out_handles) -> bool:
        """The next batch of an iterable without a length: False at its end."""
        try:
            batch = next(self.objects[iterator_id])
        except StopIteration:
            return False
        self._keep_batch(batch, out_handles)
        return True

    def _checkpoint_save(self, state_dict, path) -> None:
        checkpoint.save(state_dict, path)

    def _checkpoint_load(self, flat, path, strict) -> None:
        checkpoint.load(flat, path, strict=strict)

    def _info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "handles": len(self.table)}


_RUN = {protocol.OP: WorkerState._op, protocol.PUT: WorkerState._put, protocol.MESH: WorkerState._mesh,
        protocol.ITER: WorkerState._iter, protocol.BATCH: WorkerState._batch, protocol.GRAPH: WorkerState._graph,
        protocol.RUN_GRAPH: WorkerState._run_graph, protocol.GRAPH_BACKWARD: WorkerState._graph_backward}
_CALLS = {"stack": WorkerState._stack, "shapes": WorkerState._shapes, "item": WorkerState._item,
          "info": WorkerState._info, "dataset": WorkerState._dataset, "next_batch": WorkerState._next_batch,
          "checkpoint_save": WorkerState._checkpoint_save, "checkpoint_load": WorkerState._checkpoint_load,
          "graph_results": WorkerState._graph_results}


def _dtensors(out) -> list:
    if isinstance(out, DTensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _dtensors(o)]
    return []


def _rename_meshes(value, names: dict):
    if isinstance(value, str):
        for theirs, ours in names.items():
            value = value.replace(theirs, ours)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_rename_meshes(v, names) for v in value)
    return value


def _describe(instruction, error: Exception) -> str:
    what = instruction[1] if instruction[0] in (protocol.OP, protocol.CALL) else instruction[0]
    last = traceback.extract_tb(error.__traceback__)[-1]
    return f"{what} failed on the worker: {type(error).__name__}: {error} (at {os.path.basename(last.filename)}:" \
           f"{last.lineno})"

