"""torch's chunked linear + cross-entropy at reduction 'none' (`F.linear_cross_entropy(..., reduction="none",
options=...)`, torch >= 2.13) over DTensors: each device runs torch's own op on the rows it holds, backward
included.

Why not a rule: the op's backward is Python (it recomputes the logits a block of rows at a time into scratch
buffers of its own), which would run op by op on the DTensors, its plain buffers gathering every row. Above
autograd the whole op is one `local_map` (a kernel at the `PythonTLSSnapshot` key, which only tensor subclasses
reach): each device's call, forward and backward, is torch's on its components — the rows it holds, the classifier
whole (gathered where it is sharded) — and the classifier's gradient is the devices' sum, pending over the rows'
mesh dim. The scalar reductions have a sharded rule (engine/rules/linear_cross_entropy.py): torch computes their
gradients in the forward.
"""

from __future__ import annotations

import torch

from spmd.dtensor import DTensor
from spmd.engine.rules.linear_cross_entropy import torch_ops
from spmd.layout import UNSHARDED, Layout
from spmd.local_functions import local_map

_KEY = torch._C.DispatchKey.PythonTLSSnapshot


def _per_row_losses(keyset, input, linear_weight, target, linear_bias, weight, *options):
    tensors = (input, linear_weight, target, linear_bias, weight)
    if not any(isinstance(t, DTensor) for t in tensors):
        return _OP.redispatch(keyset.remove(_KEY), *tensors, *options)
    mesh = next(t for t in tensors if isinstance(t, DTensor))._layout.mesh
    rows = input._layout.axes[0] if isinstance(input, DTensor) else None
    rows = UNSHARDED if rows is None else rows
    given = [t for t in tensors if t is not None]
    layouts = [Layout([rows, UNSHARDED], mesh), Layout.replicated(mesh, 2), Layout([rows], mesh)]
    layouts += [Layout.replicated(mesh, 1)] * (len(given) - 3)  # a bias, class weights
    layouts = [layout if isinstance(t, DTensor) else None for layout, t in zip(layouts, given)]

    def each_device(x, w, t, *extra):
        extra = iter(extra)
        bias, class_weight = (next(extra) if linear_bias is not None else None,
                              next(extra) if weight is not None else None)
        return _OP(x, w, t, bias, class_weight, *options)
    return local_map(each_device, out_layouts=Layout([rows], mesh), in_layouts=layouts)(*given)


_OP = None
if torch_ops is not None:  # (torch < 2.13 has no chunked loss)
    _OP = torch_ops._linear_cross_entropy_batch_chunked_no_reduction._opoverload
    _LIBRARY = torch.library.Library("torch_nn", "IMPL")  # kept alive: dropping it would unregister the kernel
    _LIBRARY.impl(_OP.name().split("::")[-1], _per_row_losses, _KEY.name, with_keyset=True)
