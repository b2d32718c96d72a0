"""The session: what the controller keeps about its workers' DTensors, and how data and ops reach them.

- An op on controller DTensors runs spmd's engine on the shadows, gives each new output a handle, and is sent to
  every worker without waiting (the same engine runs it there on the real components). An op whose results' shapes
  depend on the values (`x[mask]`) runs on the workers first, and they tell the shapes.
- Real components built on the controller (`copy_to_mesh`, factories, `pack`) are adopted: each worker gets the
  rows of its own devices (a replicated value travels once per worker), and the controller keeps a shadow.
- Reads (`_local`, `.item()`) flush and gather; a worker's stored failure is raised there as `WorkerError`.
- A dropped controller DTensor frees its handle on the workers with the next message.
"""

from __future__ import annotations

import pickle
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor

from spmd.controller import checkpoint, datasets, protocol, shadow_cache, traced
from spmd.controller.errors import ControllerError, WorkerDiedError, WorkerError
from spmd.controller.remote import ControllerMesh, RemoteDTensor, remote_class, shadow
from spmd.dtensor import DTensor
from spmd.engine import dispatch, fallback
from spmd.engine.rules.value_shaped import shaped_by_values
from spmd.layout import Layout
from spmd.ops import parse_layout

_RELAYOUT = torch.ops.spmd.relayout.default
_DETACH = torch.ops.aten.detach.default
_TENSOR_RETURNS = ("Tensor", "List[Tensor]", "Optional[Tensor]", "List[Optional[Tensor]]")  # (str of a schema type)
_READS: dict = {}  # op -> whether it returns Python values (it reads the components: `.item()`, `equal`)


class Session:
    BATCH = 32  # instructions per message (see `send`)

    def __init__(self, engine, devices_per_worker: int, timeout: float):
        self.engine = engine
        self.devices_per_worker = devices_per_worker
        self.timeout = timeout
        self.closed = False
        self._next_handle = 0
        self._freed: list[int] = []
        self._buffer: list[tuple] = []  # instructions not sent yet
        self._refs: dict[int, list[weakref.ref]] = {}  # handle -> its controller objects (a detach shares one)
        self._meshes: dict[str, ControllerMesh] = {}
        self.traffic = {"sent": 0, "fetched": 0}  # bytes of components sent to (once) and fetched from the workers

    # -- sending ----------------------------------------------------------------------------------------------
    def send(self, *instructions: tuple) -> None:
        """`instructions` to every worker: buffered, and sent (with the handles freed since the last message) once
        `BATCH` are waiting or before anything that waits on the workers. A message costs both ends far more than
        an instruction (~80 us to send on Monarch), so the ops of a step travel a few dozen at a time."""
        self._check_open()
        self._buffer.extend(instructions)
        if len(self._buffer) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        """Sends the buffered instructions and frees now."""
        freed, self._freed = self._freed, []
        batch, self._buffer = self._buffer, []
        if batch or freed:
            self.engine.send_all(pickle.dumps((freed, batch), protocol=pickle.HIGHEST_PROTOCOL))

    def send_each(self, instructions: list[tuple]) -> None:
        self._check_open()
        self.flush()  # (the workers run their messages in order)
        self.engine.send_each([pickle.dumps(([], [i]), protocol=pickle.HIGHEST_PROTOCOL) for i in instructions])

    def call(self, name: str, *args, timeout: float | None = None) -> list:
        """`name(*args)` on every worker after everything sent so far; their results by rank. It waits `timeout`
        seconds (default: the collective timeout and a margin) before declaring the workers lost."""
        self._check_open()
        self.flush()
        timeout = self.timeout if timeout is None else max(timeout, self.timeout)
        try:
            replies = self.engine.call_all(pickle.dumps((name, self.encode(args))), timeout)
        except (WorkerDiedError, TimeoutError) as e:
            self.on_failure()
            if isinstance(e, WorkerDiedError):
                raise
            raise WorkerDiedError(f"the workers did not answer within {timeout:.0f} s; the controller shut them "
                                  "down") from e
        errors = [(rank, r[1]) for rank, r in enumerate(replies) if r[0] == "error"]
        if errors:
            raise WorkerError("; ".join(f"worker {rank}: {message}" for rank, message in errors))
        return [r[1] for r in replies]

    def on_failure(self) -> None:
        """Overridden by the controller: shut everything down."""
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise ControllerError("this controller is shut down: its workers and their DTensors are gone")

    # -- references -------------------------------------------------------------------------------------------
    def register_mesh(self, mesh: ControllerMesh) -> None:
        self._meshes[mesh.to_string()] = mesh
        self.send((protocol.MESH, mesh.mesh_id, mesh.dims, mesh.name))

    def meshes(self) -> list[ControllerMesh]:
        return list(self._meshes.values())

    def mesh_table(self) -> dict:
        """mesh id -> mesh (to decode the workers' references to their meshes)."""
        return {mesh.mesh_id: mesh for mesh in self._meshes.values()}

    def refs(self, value):
        if isinstance(value, RemoteDTensor):
            return protocol.Handle(value._handle)
        if isinstance(value, Layout) and isinstance(value.mesh, ControllerMesh):
            return protocol.LayoutRef(value.mesh.mesh_id, tuple(value.sharding_specs))
        if isinstance(value, ControllerMesh):
            return protocol.MeshRef(value.mesh_id)
        if isinstance(value, DTensor):
            raise ControllerError("a DTensor of this process's mesh was mixed with controller DTensors; move it "
                                  "with spmd.relayout(t, layout_on_the_controller_mesh)")
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise ControllerError("a plain meta tensor (a controller DTensor's .device is 'meta') cannot go to the "
                                  "workers: create plain tensors on 'cpu'")
        return None

    def encode(self, value):
        return protocol.encode(value, self.refs)

    def _new_handle(self, t: RemoteDTensor) -> int:
        h = self.reserve(1)[0]
        self.bind(t, h)
        return h

    def new_id(self, owner) -> int:
        """A new id for a worker-side object (a DTensor, a dataset, an iterator), freed there when `owner` is."""
        h = self.reserve(1)[0]
        self._track(owner, h)
        return h

    def reserve(self, n: int) -> list[int]:
        """`n` new ids, for worker-side DTensors whose controller objects are made later (`bind`)."""
        first = self._next_handle
        self._next_handle += n
        return list(range(first, first + n))

    def bind(self, t: RemoteDTensor, handle: int) -> None:
        t._handle, t._session = handle, self
        self._track(t, handle)

    def _track(self, owner, handle: int) -> None:
        self._refs.setdefault(handle, []).append(weakref.ref(owner, lambda ref, h=handle: self._dropped(h, ref)))

    def _dropped(self, handle: int, ref) -> None:
        owners = self._refs.get(handle, [])
        if ref in owners:
            owners.remove(ref)
        if not owners:  # the last controller object of the handle
            self._refs.pop(handle, None)
            self._freed.append(handle)

    # -- ops --------------------------------------------------------------------------------------------------
    def run_op(self, func, args, kwargs):
        self._check_open()
        reads = _READS.get(func)
        if reads is None:
            reads = _READS[func] = any(str(r.type) not in _TENSOR_RETURNS for r in
                                       func._schema.returns) and bool(func._schema.returns)
        if reads:
            return self._read(func, args, kwargs)
        if func is _DETACH and not args[0]._pending:  # (autograd detaches every gradient it stores)
            return self._alias(args[0])
        if shaped_by_values(func, args):
            return self._shaped_by_values(func, args, kwargs)
        with shadow():
            out = shadow_cache.run(func, args, kwargs)
            handles = self._adopt_outputs(out, args, kwargs)
        if func is _RELAYOUT:  # its layout string names the controller mesh: the workers' own layout instead
            layout = parse_layout(args[1])
            args = (args[0], protocol.LayoutString(self._mesh_of(layout).mesh_id, tuple(layout.sharding_specs)))
        self.send((protocol.OP, protocol.op_name(func), self.encode(args), self.encode(kwargs), handles))
        return out

    def _shaped_by_values(self, func, args, kwargs):
        """An op whose results' shapes depend on the values (`x[mask]`, `nonzero`): the workers run it, and tell
        the shapes of its results (replicated: every worker holds the same)."""
        inputs = _leaves((args, kwargs))
        if any(t._layout.sharded_mesh_dims for t in inputs):  # (the workers' warnings stay in their logs)
            fallback.warn_gathered(func)
        _resolve_shadows(inputs)
        handles = self.reserve(len(func._schema.returns))
        self.send((protocol.OP, protocol.op_name(func), self.encode(args), self.encode(kwargs), handles))
        n = inputs[0]._layout.mesh.num_local_devices()
        outs = []
        with shadow():
            for handle, (shape, dtype) in zip(handles, self.call("shapes", handles)[0]):
                stack = torch.empty(shape, dtype=dtype, device="meta").expand((n,) + shape)
                outs.append(DTensor.__new__(RemoteDTensor, stack, Layout.replicated(inputs[0]._layout.mesh,
                                                                                     len(shape)), shape))
                self.bind(outs[-1], handle)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _alias(self, t: RemoteDTensor) -> RemoteDTensor:
        """`t.detach()`: a controller object for the same worker-side DTensor (its handle), nothing sent; the
        handle is freed when the last of them is dropped."""
        with shadow():
            out = DTensor.__new__(RemoteDTensor, t._stack.detach(), t._layout, t.shape, strides=t.stride())
        self.bind(out, t._handle)
        return out

    def _adopt_outputs(self, out, args, kwargs) -> list:
        inputs = {id(t) for t in _leaves((args, kwargs))}
        handles = []
        for t in _leaves(out):
            if id(t) in inputs:
                handles.append(None)  # an in-place op's target: the workers' op returns the same tensor
            else:
                t.__class__ = remote_class(type(t))
                handles.append(self._new_handle(t))
        return handles

    def _read(self, func, args, kwargs):
        """An op that returns Python values: run by every worker (it may resolve a pending reduction, a
        collective), the value of worker 0."""
        _resolve_shadows(_leaves((args, kwargs)))
        return self.call("item", protocol.op_name(func), args, kwargs)[0]

    def _mesh_of(self, layout: Layout) -> ControllerMesh:
        mesh = self._meshes.get(layout.mesh.to_string())
        if mesh is None:
            raise ControllerError(f"{layout.mesh!r} is not a mesh of this controller")
        return mesh

    # -- data in and out --------------------------------------------------------------------------------------
    def adopt(self, t: DTensor) -> RemoteDTensor:
        """Sends the real components of `t` (built on the controller) to the workers; returns its remote twin."""
        stack = t._stack
        if isinstance(stack, FakeTensor):  # a value of a graph that `spmd.function` traces: nothing to send
            return t
        if stack.is_meta:
            raise ControllerError("a DTensor of a controller mesh was built from shadow components outside the "
                                  "engine; spmd.controller supports the public API (ops, relayout, copy_to_mesh, "
                                  "factories, pack/unpack)")
        with shadow():
            twin = DTensor.__new__(remote_class(type(t)), torch.empty_strided(stack.shape, stack.stride(),
                                   dtype=stack.dtype, device="meta"), t._layout, t.shape, t.requires_grad,
                                   t._pending, t._pending_op)
        h = self._new_handle(twin)
        ref = self.refs(t._layout)
        if t._layout.is_fully_replicated() and not t._pending:  # one copy per worker, expanded there
            value = stack[0].detach().contiguous()
            self.traffic["sent"] += value.nbytes
            self.send((protocol.PUT, h, ref, value, True))
        else:
            n = self.devices_per_worker
            rows = [r.contiguous() for r in stack.detach().split(n)]
            self.traffic["sent"] += sum(r.nbytes for r in rows)
            self.send_each([(protocol.PUT, h, ref, r, False) for r in rows])
        return twin

    def fetch_stack(self, t: RemoteDTensor) -> torch.Tensor:
        """The real stacked components of every device (resolved), gathered from the workers."""
        _resolve_shadows([t])
        stack = torch.cat(self.call("stack", t))
        self.traffic["fetched"] += stack.nbytes
        return stack

    def sync(self) -> None:
        """Waits until the workers ran everything sent so far; raises a stored worker failure."""
        self.call("info")

    # -- done by the workers: traced graphs, checkpoints, datasets (spmd.function, .checkpoint, .data call these) --
    def compile_graph(self, function, gm, example_inputs):
        """A graph `spmd.function` traced on this session's meshes: compiled and run by the workers."""
        return traced.compile_graph(self, function, gm, example_inputs)

    def checkpoint_save(self, state_dict, path) -> None:
        checkpoint.save(self, state_dict, path)

    def checkpoint_load(self, flat: dict, mappings: dict, template: dict, path, strict: bool) -> None:
        checkpoint.load(self, flat, mappings, template, path, strict)

    def dataset_on_workers(self, dataset) -> datasets.OnWorkers:
        return datasets.OnWorkers(dataset)


def _resolve_shadows(tensors) -> None:
    """Resolves the pending reductions of `tensors`' shadows, as the workers' op resolves theirs, so that each shadow
    keeps its worker-side state."""
    for t in tensors:
        if t._pending:
            with shadow():
                dispatch.resolve(t)


def _leaves(value) -> list:
    if isinstance(value, DTensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    return []
