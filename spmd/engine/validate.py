"""torch's own argument checks, run on the global shapes before a rule sees an op.

Rules work on stacked components `(L, *local_shape)`: an axis index that is out of range for the global tensor
may still be in range for the stack, and a shape error raised by a kernel names the components' shapes. So each
new call signature (a dispatch cache miss) first runs the op on meta tensors of the arguments' global shapes:
a bad `dim`, shapes that do not match, an impossible `view` raise torch's own error, naming the user's shapes
and dims. Nothing is computed; ops without a meta kernel, or whose meta kernel cannot run (data-dependent
output shapes, reading a value), are not checked here. An op whose tensors are all empty also runs its real
kernel (that is free): meta kernels do not check that a reduction without identity (`amax`) is not over a
zero-size dim.
"""

from __future__ import annotations

import re

import torch
import torch.utils._pytree as pytree
from torch._dispatch.python import no_python_dispatcher
from torch._prims_common import canonicalize_dim
from torch.utils._python_dispatch import _disable_current_modes

_SKIP_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
aten = torch.ops.aten
# ops whose meta kernels accept any `dim`: it is checked against the input's rank here
_DIM_UNCHECKED_BY_META = {aten._softmax.default, aten._log_softmax.default, aten.sort.default, aten.sort.stable}
# ops whose meta kernels refuse what the CPU kernel takes (`_grouped_mm`: bfloat16 only, CUDA's restriction); the
# rule and the device's kernel check them
_META_STRICTER_THAN_KERNELS = {aten._grouped_mm.default}
# torch 2.11's meta kernels (argmax, topk, cummax, kthvalue, ...) word a bad `dim` as an AssertionError; later
# versions raise the IndexError of the CPU kernels
_META_DIM_ASSERTION = re.compile(r"dim (-?\d+) out of bounds \(-?\d+, (-?\d+)\)")


class _Unchecked(Exception):
    """An argument that has no meta counterpart (a symbolic shape inside a trace)."""


# what torch's errors say where an op has no meta kernel, or one that cannot run without values
_NO_META_KERNEL = ("meta", "not allocated", "no fake impl")  # (the last: a torch.library custom op's)


def check_like_torch(func, args, kwargs) -> None:
    """Raises what torch raises for `func(*args, **kwargs)` on plain tensors of the same global shapes."""
    if any(tag in func.tags for tag in _SKIP_TAGS) or func in _META_STRICTER_THAN_KERNELS:
        return
    if func in _DIM_UNCHECKED_BY_META:
        _check_dim(func, args, kwargs)
    # inside a trace: check, do not record, and run the meta kernels as eagerly (the trace's Python dispatcher sent
    # `_to_copy` of a meta tensor to a CPU device into endless recursion)
    with _disable_current_modes(), no_python_dispatcher():
        try:
            meta_args, meta_kwargs = pytree.tree_map(_meta, (args, kwargs))
        except _Unchecked:
            return
        meta_error = None
        try:
            func(*meta_args, **meta_kwargs)
        except (IndexError, ValueError, TypeError):
            raise
        except AssertionError as e:
            _raise_if_bad_dim(e)
            return
        except RuntimeError as e:
            meta_error = e
        except Exception:  # noqa: BLE001  no meta kernel, or one that needs values: the rule decides
            return
        _raise_if_empty_has_no_identity(func, args, kwargs)
        message = str(meta_error).lower()
        if meta_error is not None and not any(m in message for m in _NO_META_KERNEL):
            raise meta_error  # not a limit of meta tensors: the arguments are wrong


def _raise_if_empty_has_no_identity(func, args, kwargs) -> None:
    """torch's IndexError for a reduction without identity over a zero-size dim (`amax(0)` of a (0, 4) tensor),
    or `max()` of an empty tensor, which meta kernels word differently or do not raise: when every tensor argument
    is empty, running the real kernel costs nothing. Its errors are raised unless the CPU kernel lacks the dtype
    (the device's may have it)."""
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if not tensors or any(t.numel() != 0 for t in tensors):
        return
    empty_args, empty_kwargs = pytree.tree_map(_empty, (args, kwargs))
    try:
        func(*empty_args, **empty_kwargs)
    except IndexError:
        raise
    except RuntimeError as e:
        if "not implemented" not in str(e):
            raise
    except Exception:  # noqa: BLE001  the meta kernel's verdict stands
        return


def _check_dim(func, args, kwargs) -> None:
    names = [a.name for a in func._schema.arguments]
    dim = kwargs.get("dim", args[names.index("dim")] if len(args) > names.index("dim") else None)
    if dim is not None:
        canonicalize_dim(args[0].dim(), dim)  # torch's IndexError for a dim out of range


def _raise_if_bad_dim(error: AssertionError) -> None:
    match = _META_DIM_ASSERTION.fullmatch(str(error))
    if match:
        dim, last = map(int, match.groups())
        canonicalize_dim(last + 1, dim)  # torch's IndexError for a dim out of range


def _empty(value):
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty(tuple(value.shape), dtype=value.dtype)


def _meta(value):
    if not isinstance(value, torch.Tensor):
        return value
    shape, stride = tuple(value.shape), value.stride()
    if not all(type(s) is int for s in shape + stride):
        raise _Unchecked
    return torch.empty_strided(shape, stride, dtype=value.dtype, device="meta")


# a kernel's error that names an axis of the stacked components it ran on: one more than the user's axis
_STACKED_DIM = re.compile(r"(out of bounds for dimension )(\d+)")


def name_the_user_dim(error: Exception) -> None:
    """Rewords a kernel's error (an index out of bounds, found as it ran) to name the user's axis, not the
    stacked components' (once: an error raised by an op inside another op's expansion passes both)."""
    message = str(error.args[0]) if error.args else ""
    match = _STACKED_DIM.search(message)
    if match and int(match[2]) > 0 and not getattr(error, "_spmd_user_dim", False):
        error.args = (message[:match.start(2)] + str(int(match[2]) - 1) + message[match.end(2):],) + error.args[1:]
        named_for_the_user(error)


def named_for_the_user(error: Exception) -> Exception:
    """`error`, marked as naming the user's axes already (a rule's own check): left as it is by
    `name_the_user_dim`."""
    error._spmd_user_dim = True
    return error
