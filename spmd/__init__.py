"""spmd: the Distribution API of TF DTensor on PyTorch.

A `Mesh` of devices with named dimensions, a `Layout` per tensor saying how each axis is sharded over it, and
DTensors that behave as one global `torch.Tensor` while each device holds only its component.
"""

from spmd import checkpoint, interop, random
from spmd.api import copy_to_mesh, pack, relayout, relayout_like, to_global, unpack
from spmd.creation import call_with_layout, empty, fill, full, ones, ones_like, zeros, zeros_like
from spmd.data import DTensorDataset, create_dtensor_iterable
from spmd.engine.dispatch import cache_stats
from spmd.dtensor import DTensor, check_layout, fetch_layout, is_dtensor
from spmd.explain import CollectiveRecord, Explanation
from spmd.errors import (CheckpointError, CollectiveError, IndivisibleError, LayoutError, MeshMismatchError,
                         MixedTensorError, TraceError, UnsupportedOpError)
from spmd.layout import MATCH, UNSHARDED, Layout
from spmd.mesh import Mesh, MeshDimension, create_mesh
from spmd import runtime
from spmd.runtime import (barrier, client_id, create_distributed_mesh, initialize_accelerator_system, job_name,
                          local_devices, num_clients, num_global_devices, num_local_devices,
                          shutdown_accelerator_system)
from spmd.controller import Controller
from spmd.function_mode import Function, function
from spmd.interop import from_jax_array, from_torch_dtensor, to_jax_array, to_torch_dtensor
from spmd.local_functions import axis_index, local_map
from spmd.experts import expert_parallel
from spmd.custom_ops import register_sharding
from spmd import chunked_losses  # noqa: F401  (torch's chunked loss at reduction 'none', per device)
from spmd.buckets import no_sync
from spmd.nn import LayoutMap, Strategy, distribute_module
from spmd.tp_plans import layout_map_from_tp_plan
from spmd.scope import default_mesh, get_default_mesh, implicit_replication
from spmd.variable import DVariable
from spmd.visualize import visualize
from spmd.tracing import prepare_when_dynamo_loads

prepare_when_dynamo_loads()  # last: Dynamo is told to skip the frames of every module imported above

__version__ = "0.1.0"

__all__ = [
    "Mesh", "MeshDimension", "Layout", "UNSHARDED", "MATCH", "create_mesh", "DTensor", "DVariable",
    "pack", "unpack", "fetch_layout", "check_layout", "is_dtensor", "relayout", "relayout_like", "copy_to_mesh",
    "to_global", "call_with_layout", "default_mesh", "get_default_mesh", "implicit_replication", "zeros", "ones", "empty", "fill", "full",
    "zeros_like", "ones_like", "random", "checkpoint", "cache_stats", "LayoutError", "IndivisibleError", "MeshMismatchError",
    "MixedTensorError", "UnsupportedOpError", "DTensorDataset", "create_dtensor_iterable",
    "LayoutMap", "distribute_module", "Strategy", "no_sync", "visualize",
    "runtime", "initialize_accelerator_system", "shutdown_accelerator_system", "client_id", "num_clients",
    "job_name", "local_devices", "num_local_devices", "num_global_devices", "create_distributed_mesh", "barrier",
    "CheckpointError", "CollectiveError", "function", "Function", "Explanation", "CollectiveRecord", "TraceError",
    "Controller", "interop", "to_torch_dtensor", "from_torch_dtensor", "to_jax_array", "from_jax_array",
    "local_map", "axis_index", "expert_parallel", "register_sharding",
    "layout_map_from_tp_plan",
]
