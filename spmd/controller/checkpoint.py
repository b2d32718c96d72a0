"""`spmd.checkpoint` on a controller mesh: each worker writes and reads the shards of its own devices.

A state dict holding controller DTensors (a model distributed on a controller mesh, its optimizer) is saved and
loaded by the workers themselves, each an ordinary multi-client spmd process: the controller sends the request
(the state dict with each DTensor named by its handle) and waits. So the files are exactly those of a multi-client
run (a controller checkpoint loads in local or multi-client mode and vice versa), and no component goes through
the controller's memory.

- **save**: every worker runs `spmd.checkpoint.save` on its side of the state dict (plain tensors and Python values
  travel with the request; DCP has worker 0 write them).
- **load**: the controller checks the template against the checkpoint's metadata (so errors name the entry here),
  the workers load its controller DTensors in place, and the controller loads the rest (plain tensors, Python
  values: its own data) itself; modules and optimizers are then restored on the controller as in local mode.

The checkpoint's path must name the same directory on the workers (made absolute here; the workers share this
host).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch

from spmd import checkpoint
from spmd.checkpoint import _overlaps, _real_key
from spmd.controller.remote import RemoteDTensor, shadow
from spmd.engine import dispatch

# seconds the controller waits for a save or load: writing the files may take far longer than a read (a worker that
# dies is still reported at once, and the workers' collectives keep their own timeout)
TIMEOUT = float(os.environ.get("SPMD_CONTROLLER_CHECKPOINT_TIMEOUT", 3600))


def save(session, state_dict: Mapping, path: Path) -> None:
    """Has every worker save its side of `state_dict` (modules and optimizers already turned into state dicts)."""
    state = _as_dicts(state_dict)
    _settle(_remote_leaves(state))
    session.call("checkpoint_save", state, str(Path(path).absolute()), timeout=TIMEOUT)


def load(session, flat: dict, mappings: dict, template: dict, path: Path, strict: bool) -> None:
    """Fills the flattened template `flat`: its controller DTensors on the workers, in place; its other entries here
    (each non-tensor value also written back into the nested `template` at its path in `mappings`)."""
    remote = {fqn: v for fqn, v in flat.items() if isinstance(v, RemoteDTensor)}
    here = {fqn: v for fqn, v in flat.items() if not isinstance(v, RemoteDTensor)}
    _as_loaded(list(remote.values()))
    session.call("checkpoint_load", remote, str(Path(path).absolute()), strict, timeout=TIMEOUT)
    if here:
        checkpoint.load(here, path, strict=strict)
        for fqn, value in here.items():
            _put(template, mappings[fqn], value)


def _as_dicts(value):
    """`value` with every mapping a plain dict (a module's `OrderedDict` state dict included): the form the
    controller's protocol encodes."""
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_as_dicts(v) for v in value)
    return value


def _remote_leaves(value) -> list:
    if isinstance(value, RemoteDTensor):
        return [value]
    children = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return [t for child in children for t in _remote_leaves(child)]


def _settle(tensors: list) -> None:
    """Resolves pending reductions on the shadows, as the workers' planners do when they read the components."""
    with shadow():
        for t in tensors:
            if t._pending:
                dispatch.resolve(t)


def _as_loaded(tensors: list) -> None:
    """Also gives a shadow whose elements overlap (expanded components) the contiguous strides that the workers'
    load planner gives such components before filling them."""
    _settle(tensors)
    for t in tensors:
        if _overlaps(t._stack):
            t._settle(torch.empty(t._stack.shape, dtype=t._stack.dtype, device="meta"))


def _put(container, path: tuple, value) -> None:
    for part in path[:-1]:
        container = container[_real_key(container, part)]
    key = _real_key(container, path[-1])
    if not (isinstance(value, torch.Tensor) and container[key] is value):
        container[key] = value
