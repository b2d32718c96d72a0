"""The exception family of spmd.

Every user-facing error is a subclass of a builtin (`ValueError`, `TypeError`, `NotImplementedError`) so
callers can catch what they already catch, and names the shapes, layouts and meshes involved.
"""


class LayoutError(ValueError):
    """A layout or mesh that is invalid, or does not fit the tensor it is applied to."""


class IndivisibleError(LayoutError):
    """A tensor axis whose size does not divide by the number of shards its layout asks for."""


class MeshMismatchError(ValueError):
    """DTensors on different meshes met in one op (or one assignment)."""


class MixedTensorError(TypeError):
    """A plain (non-scalar) torch.Tensor was mixed with DTensors."""


class UnsupportedOpError(NotImplementedError):
    """An op without a sharding rule for the given layouts."""


class CollectiveError(RuntimeError):
    """A collective across clients failed or timed out (a client died, stalled, or ran a different program);
    the message names this client, the collective, the mesh dimensions and the clients involved."""


class TraceError(RuntimeError):
    """`spmd.function` could not trace a function as one graph (e.g. Python control flow on a DTensor's values);
    the message names the reason and the line of the user's function."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: a file of it is missing, truncated or corrupted; the message names the
    checkpoint and the file."""
