"""PyTorch/XLA's SPMD API (seed 001) on spmd: port a program by changing its import.

    import spmd.xla as xs                     # instead of torch_xla.distributed.spmd (xla_sharding)
    import spmd.xla.xla_model as xm           # instead of torch_xla.core.xla_model
    import spmd.xla.runtime as xr             # instead of torch_xla.runtime

`Mesh` (device ids in a custom order, optional axis names), `mark_sharding(t, mesh, partition_spec)` (annotates
`t` in place and returns it as an `XLAShardedTensor`), `clear_sharding`, `shard_module`, `get_1d_mesh`.
The difference to an XLA device: annotations take effect at once (eager), and `spmd.function` is the lazy,
whole-graph mode where an annotation becomes a layout constraint.
"""

from spmd.xla import runtime, xla_model
from spmd.xla.mesh import Mesh, get_1d_mesh
from spmd.xla.sharded_tensor import ShardingType, XLAShard, XLAShardedTensor
from spmd.xla.sharding import clear_sharding, layout_of_partition_spec, mark_sharding, shard_module

__all__ = ["Mesh", "get_1d_mesh", "mark_sharding", "clear_sharding", "shard_module", "layout_of_partition_spec",
           "XLAShardedTensor", "XLAShard", "ShardingType", "runtime", "xla_model"]
