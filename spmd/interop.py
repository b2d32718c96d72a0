"""DTensors to and from JAX's `jax.Array` and torch's own DTensor (`torch.distributed.tensor.DTensor`).

JAX: an in-process mesh's components become the per-device shards of a `jax.Array` with the layout's
`NamedSharding`, and back (each component copied once; jax is optional).

torch DTensor: one process holds one device's shard, so a tensor converts where this process holds exactly one
device of the mesh — a multi-client mesh under torchrun (one device per process), or a 1-device mesh in a world of
one process. The local component is shared (no copy), and a pending reduction is a `Partial` placement.
"""

from __future__ import annotations

import torch

from spmd import clients, jax_sharding, torch_placements
from spmd.api import pack
from spmd.dtensor import DTensor
from spmd.errors import LayoutError
from spmd.layout import Layout
from spmd.mesh import Mesh, create_mesh
from spmd.runtime import create_distributed_mesh

_WIDE = (torch.float64, torch.int64, torch.complex128, torch.uint64)


# -- JAX -----------------------------------------------------------------------------------------------------------
def to_jax_array(tensor: DTensor, jax_mesh=None):
    """A `jax.Array` with `tensor`'s global value, sharded like it: each device's component becomes the shard of
    the jax device at the same mesh position (a pending reduction is resolved first; the data is copied).

    Args:
      tensor: a DTensor on an in-process mesh.
      jax_mesh: the `jax.sharding.Mesh` to use (same axis names and sizes); default `mesh.to_jax()`.

    Raises:
      LayoutError: a multi-client mesh (jax's multi-process runtime is not spmd's: use `spmd.to_global`).
      TypeError: a 64-bit dtype while jax has them disabled (jax would silently narrow it).
    """
    jax = jax_sharding.import_jax()
    layout = _layout_of(tensor, "to_jax_array")
    if not layout.mesh.is_fully_local():
        raise LayoutError(f"to_jax_array converts DTensors of in-process meshes; {layout.mesh!r} spans several "
                          "clients (this one holds a part of it): take spmd.to_global(tensor) or convert on one "
                          "process")
    _check_wide(tensor.dtype, jax)
    sharding = layout.to_jax(jax_mesh)
    components = tensor._local.detach().resolve_conj().resolve_neg()
    shards = [jax.dlpack.from_dlpack(c.clone(memory_format=torch.contiguous_format), device=d)
              for c, d in zip(components.unbind(0), sharding.mesh.devices.flat)]
    return jax.make_array_from_single_device_arrays(tuple(tensor.shape), sharding, shards)


def _check_wide(dtype: torch.dtype, jax) -> None:
    if dtype in _WIDE and not jax.config.jax_enable_x64:
        raise TypeError(f"jax has 64-bit types disabled, so the {dtype} components would be narrowed to 32 bits: "
                        "enable them with jax.config.update('jax_enable_x64', True), or convert the DTensor "
                        "first (e.g. tensor.to(torch.float32))")


def from_jax_array(array, mesh: Mesh | None = None) -> DTensor:
    """A DTensor with the value and sharding of the `jax.Array` `array` (a `NamedSharding`, every shard in this
    process); the component of mesh position k is the shard of jax's device at position k (copied).

    Args:
      mesh: the spmd mesh (the jax mesh's axis names and sizes); default `Mesh.from_jax(array.sharding.mesh)`.
    """
    jax = jax_sharding.import_jax()
    if not isinstance(array, jax.Array):
        raise TypeError(f"from_jax_array expects a jax.Array, got {type(array).__name__}")
    if not array.is_fully_addressable:
        raise LayoutError(f"the jax array of shape {array.shape} has shards in other processes ({array.sharding}); "
                          "from_jax_array converts arrays whose every shard is in this process")
    layout = Layout.from_jax(array.sharding, mesh, rank=array.ndim)
    data = {s.device: s.data for s in array.addressable_shards}
    components = [torch.from_dlpack(data[d]) for d in array.sharding.mesh.devices.flat]
    return pack(components, layout)


# -- torch.distributed.tensor ----------------------------------------------------------------------------------------
_DEVICE_MESHES: dict = {}  # (spmd mesh, world group) -> DeviceMesh: building one creates process groups
_MESHES: dict = {}  # (dim names, shape, device type, world group) -> the spmd mesh create_distributed_mesh made


def to_torch_dtensor(tensor: DTensor, device_mesh=None):
    """A `torch.distributed.tensor.DTensor` sharing this process's component of `tensor` (no copy).

    Its placements are `tensor`'s layout (`Layout.to_torch`), with `Partial(op)` on the mesh dims of a pending
    reduction. The result is not connected to `tensor`'s autograd graph (like `detach()`, it shares memory).

    Args:
      tensor: a DTensor whose mesh has exactly one device in this process: a multi-client mesh with one device per
        process (torchrun), or a 1-device in-process mesh with a world of one process.
      device_mesh: a torch `DeviceMesh` of the same shape; default one built over the default process group with
        the mesh's shape and dim names (once per mesh; building it is a collective).

    Raises:
      LayoutError: the mesh has several devices in this process, or does not match the process group.
      RuntimeError: torch.distributed has no default process group.
    """
    from torch.distributed.tensor import DTensor as TorchDTensor
    layout = _layout_of(tensor, "to_torch_dtensor")
    mesh = layout.mesh
    _check_one_device(mesh, "to_torch_dtensor")
    rank, world = _process_group("to_torch_dtensor", mesh)
    if device_mesh is None:
        _check_positions(mesh, rank, world)
        device_mesh = _device_mesh(mesh)
    _check_device_mesh(mesh, device_mesh)
    placements = torch_placements.to_placements(mesh.dim_names, layout.axes, tensor._pending, tensor._pending_op)
    return TorchDTensor.from_local(tensor._stack[0].detach(), device_mesh, placements, run_check=False,
                                   shape=tensor.shape, stride=tensor.stride())


def from_torch_dtensor(tensor, mesh: Mesh | None = None) -> DTensor:
    """An spmd DTensor sharing the local shard of the torch DTensor `tensor` (no copy); a `Partial` placement
    becomes a pending reduction (resolved when the tensor is next read).

    Args:
      mesh: the spmd mesh (the DeviceMesh's shape and dim names, one device per process). Default: under several
        processes the mesh `spmd.create_distributed_mesh` makes (spmd's runtime must be initialised; a
        collective the first time), in a world of one process a 1-device in-process mesh. A DeviceMesh
        without dim names gets `dim0, dim1, ...`.

    Raises:
      LayoutError: a tensor axis sharded over several mesh dims, uneven shards (`IndivisibleError`), or a mesh
        that does not match the DeviceMesh.
    """
    from torch.distributed.tensor import DTensor as TorchDTensor
    if not isinstance(tensor, TorchDTensor):
        raise TypeError(f"from_torch_dtensor expects a torch.distributed.tensor.DTensor, got "
                        f"{type(tensor).__name__}")
    device_mesh = tensor.device_mesh
    local = tensor.to_local().detach()
    if mesh is None:
        mesh = _spmd_mesh(device_mesh, local.device)
    _check_one_device(mesh, "from_torch_dtensor")
    _check_device_mesh(mesh, device_mesh)
    axes, pending, op = torch_placements.split(mesh.dim_names, tensor.placements, tensor.dim())
    layout = Layout.from_axes(axes, mesh)
    layout.check_divisible(tuple(tensor.shape))
    if local.device != mesh.torch_device:
        raise LayoutError(f"the torch DTensor's shard is on {local.device} but {mesh!r} computes on "
                          f"{mesh.torch_device}; move the tensor or pass a mesh of that device")
    return DTensor(local.unsqueeze(0), layout, tuple(tensor.shape), pending=pending, pending_op=op)


def _layout_of(tensor, what: str) -> Layout:
    if not isinstance(tensor, DTensor):
        raise TypeError(f"{what} expects an spmd DTensor, got {type(tensor).__name__}")
    return tensor._layout


def _check_one_device(mesh: Mesh, what: str) -> None:
    n = mesh.num_local_devices()
    if n == 1:
        return
    where = "in-process mesh" if mesh.is_fully_local() else "multi-client mesh"
    raise LayoutError(
        f"{what}: this process holds {n} devices of the {where} {mesh.dim_names} {mesh.shape()}, but a torch "
        "DTensor holds one device's shard per process. Run under torchrun with one device per process "
        "(spmd.initialize_accelerator_system, then spmd.create_distributed_mesh), or go through the global value "
        "(spmd.to_global, or spmd.copy_to_mesh onto a 1-device mesh)")


def _process_group(what: str, mesh: Mesh) -> tuple[int, int]:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what}: torch.distributed has no default process group, and a torch DTensor needs one even on one "
            "device. Launch with torchrun and call spmd.initialize_accelerator_system(), or for one process call "
            "torch.distributed.init_process_group('gloo', rank=0, world_size=1, store=torch.distributed.HashStore()) "
            f"first (mesh {mesh.dim_names} {mesh.shape()})")
    return dist.get_rank(), dist.get_world_size()


def _check_positions(mesh: Mesh, rank: int, world: int) -> None:
    """spmd's meshes put client k's device at position k: the DeviceMesh over ranks 0..world-1 in order."""
    position = mesh.local_device_ids()[0] - mesh.min_global_device_id()
    if mesh.size != world or position != rank:
        raise LayoutError(f"mesh {mesh.dim_names} {mesh.shape()} has {mesh.size} devices, this process's at "
                          f"position {position}, but torch.distributed has {world} processes and this is rank "
                          f"{rank}: the default DeviceMesh puts rank k at position k; pass device_mesh= for "
                          "another arrangement")


def _device_mesh(mesh: Mesh):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    key = (mesh, dist.group.WORLD)
    if key not in _DEVICE_MESHES:
        ranks = torch.arange(mesh.size).reshape(mesh.shape())
        _DEVICE_MESHES[key] = DeviceMesh(mesh.torch_device.type, ranks, mesh_dim_names=tuple(mesh.dim_names))
    return _DEVICE_MESHES[key]


def _check_device_mesh(mesh: Mesh, device_mesh) -> None:
    """Same shape, same dim names (where the DeviceMesh has them), this process at the same coordinates."""
    names = device_mesh.mesh_dim_names
    shape = list(device_mesh.mesh.shape)
    position = mesh.local_device_ids()[0] - mesh.min_global_device_id()
    mine = mesh.device_location(position)
    theirs = list(device_mesh.get_coordinate() or ())
    if shape != mesh.shape() or (names is not None and list(names) != mesh.dim_names) or theirs != mine:
        raise LayoutError(f"the DeviceMesh (dims {names}, shape {shape}, this rank at {theirs}) does not match the "
                          f"spmd mesh (dims {mesh.dim_names}, shape {mesh.shape()}, this process's device at "
                          f"{mine}); they must agree on shape, dim names and where this process sits")


def _spmd_mesh(device_mesh, device: torch.device) -> Mesh:
    import torch.distributed as dist
    shape = tuple(device_mesh.mesh.shape)
    names = tuple(device_mesh.mesh_dim_names or (f"dim{i}" for i in range(len(shape))))
    kind = "GPU" if device.type == "cuda" else device.type.upper()
    world = dist.get_world_size()
    if device_mesh.mesh.flatten().tolist() != list(range(world)):
        raise LayoutError(f"the DeviceMesh {device_mesh} does not hold ranks 0..{world - 1} in order; spmd's "
                          "multi-client meshes span every process, process k at position k: pass mesh=")
    if world == 1:
        index = 0 if device.index is None else device.index
        return create_mesh(list(zip(names, shape)), devices=[f"{kind}:{index}"])
    state = clients.current()
    if state is None or state.num_clients != world:
        raise LayoutError(f"from_torch_dtensor builds the spmd mesh for {world} processes with "
                          "spmd.create_distributed_mesh, which needs spmd.initialize_accelerator_system() first "
                          "(it joins torch.distributed's process group); or pass mesh=")
    key = (names, shape, kind, dist.group.WORLD)
    if key not in _MESHES:
        _MESHES[key] = create_distributed_mesh(list(zip(names, shape)), local_devices=[f"{kind}:0"])
    return _MESHES[key]


__all__ = ["to_jax_array", "from_jax_array", "to_torch_dtensor", "from_torch_dtensor"]
