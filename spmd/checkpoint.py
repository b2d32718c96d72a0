"""Sharded checkpoints that reshard on load, in `torch.distributed.checkpoint`'s (DCP) format.

`save(state_dict, path)` writes every distinct shard of every DTensor exactly once (the device holding the first
replica of a shard writes it) plus plain tensors and Python values; `load(state_dict, path)` fills the given
state dict in place, each tensor in ITS layout: any mesh, layout or number of devices, or plain tensors. The
files are an ordinary DCP checkpoint, so plain PyTorch reads them with `torch.distributed.checkpoint.load`.

How it plugs into DCP: `SavePlanner` and `LoadPlanner` extend DCP's default planners. For a DTensor they plan
one write item per shard this client must write and one chunk per distinct shard its devices hold; DCP's own
resharding (`create_read_items_for_chunk_list`) computes which pieces of which saved chunks fill each chunk.
Which shards are this client's follows only from `mesh.local_device_ids()` and the layout (`local_blocks`), so
with several processes each writes and reads only the shards of its own devices. A block read once is copied
to the other local devices that hold a replica of it.

`nn.Module`s, optimizers and other objects with `state_dict()`/`load_state_dict()` (LR schedulers) may stand in
the state dict: they are saved as their `state_dict()` and restored with `load_state_dict()`; an optimizer that
has not stepped yet gets its state tensors from the checkpoint (laid out like their parameters).

A save writes into a hidden temporary directory next to `path` and renames it into place only after DCP has
written every shard and the metadata, so an interrupted save never leaves a `path` that loads. A save that was
killed leaves that directory behind (`.NAME.tmp-HOST-PID-ID`); the next successful save of `NAME` removes it once it
is stale: its process (on this host) no longer runs, or nothing in it changed for `SPMD_CHECKPOINT_STALE_AFTER`
seconds (default 3600: a save in progress keeps writing; another host's process cannot be asked).

A state dict holding controller DTensors (single-controller mode) is saved and loaded by the workers, each running
`save`/`load` as one client of a multi-client run (spmd/controller/checkpoint.py): the same files, and nothing
through the controller.

A load reads through `_Reader`, which names the checkpoint and the file when a file is missing, truncated or not
what DCP wrote (`spmd.errors.CheckpointError`) instead of passing on pickle's or torch's bare error.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import shutil
import socket
import time
import uuid
import zlib
import warnings
from pathlib import Path
from typing import Mapping, MutableMapping

import torch

from spmd.collectives.distributed import CHECKPOINT_LOAD, CHECKPOINT_SAVE, check_boundary
from spmd.collectives.groups import lost_peer, unreachable
from spmd.collectives.local import shared
from spmd.dtensor import DTensor
from spmd.errors import CheckpointError, CollectiveError
from spmd.shards import Block, block_at, create_write_items, local_blocks  # Block, local_blocks: public here too

__all__ = ["save", "load", "is_checkpoint", "SavePlanner", "LoadPlanner", "Block", "local_blocks", "CheckpointError"]

_METADATA = ".metadata"  # the file DCP's FileSystemWriter writes last


# -- the DCP planners -----------------------------------------------------------------------------------------------
def _dcp():
    """torch.distributed.checkpoint, imported on first use (it costs ~0.5 s; `import spmd` does not pay it)."""
    import torch.distributed.checkpoint as dcp
    return dcp


def _planner_classes():
    global _PLANNERS
    if _PLANNERS is not None:
        return _PLANNERS
    from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                              create_default_local_load_plan,
                                                              create_default_local_save_plan)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan, SavePlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SavePlanner(DefaultSavePlanner):
        """DCP's default save planner, plus: a DTensor is written as its distinct shards, each by one client
        (the one holding its first replica), as `WriteItemType.SHARD` chunks of the global tensor."""

        def create_local_plan(self):
            others = {fqn: v for fqn, v in self.state_dict.items() if not isinstance(v, DTensor)}
            items = list(create_default_local_save_plan(others, self.is_coordinator).items)
            for fqn, value in self.state_dict.items():
                if isinstance(value, DTensor):
                    items += create_write_items(value, fqn, value)
            plan = SavePlan(items)
            if self.flatten_state_dict:
                plan = dataclasses.replace(plan, planner_data=self.mappings)
            self.plan = plan
            return plan

        def lookup_object(self, index):
            value = self.state_dict.get(index.fqn)
            if isinstance(value, DTensor):
                component = value._local[block_at(value, index.offset).positions[0]].detach()
                # a view would make torch.save write the whole stacked storage
                return component.clone(memory_format=torch.contiguous_format)
            return super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        """DCP's default load planner, plus: a DTensor of the state dict is filled in its own layout. Each
        distinct shard its client holds is one chunk (DCP reshards the saved chunks into it); once a chunk is
        complete it is copied to the other local devices holding a replica of it. Missing keys (unless
        `allow_partial_load`) and shape mismatches raise, naming the tensor."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            super().set_up_planner(state_dict, metadata, is_coordinator)
            for value in self.state_dict.values():
                # (a stack shared by every device holds one replicated value: loading one component loads all)
                if isinstance(value, DTensor) and _overlaps(value._local) and not shared(value._local):
                    value._settle(value._local.clone(memory_format=torch.contiguous_format))

        def create_local_plan(self):
            _check_against(self.state_dict, self.metadata, strict=not self.allow_partial_load)
            items, self._pending = [], {}
            for fqn, value in self.state_dict.items():
                if fqn not in self.metadata.state_dict_metadata:
                    continue
                if not isinstance(value, DTensor):
                    items += create_default_local_load_plan({fqn: value}, self.metadata, True).items
                    continue
                blocks = local_blocks(value._layout, value.shape)
                chunks = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in blocks]
                reads = create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
                for read in reads:
                    key = (fqn, tuple(read.dest_index.offset))
                    self._pending[key] = self._pending.get(key, 0) + 1
                items += reads
            return LoadPlan(items)

        def lookup_tensor(self, index):
            value = self.state_dict.get(index.fqn)
            if isinstance(value, DTensor):
                return value._local[block_at(value, index.offset).positions[0]]
            return super().lookup_tensor(index)

        def commit_tensor(self, read_item, tensor):
            value = self.state_dict.get(read_item.dest_index.fqn)
            if not isinstance(value, DTensor):
                return super().commit_tensor(read_item, tensor)
            key = (read_item.dest_index.fqn, tuple(read_item.dest_index.offset))
            self._pending[key] -= 1
            if self._pending[key] == 0:  # the chunk is complete: copy it to the local replicas
                first, *replicas = block_at(value, key[1]).positions
                with torch.no_grad():
                    for position in replicas:
                        value._local[position].copy_(value._local[first])

        def load_bytes(self, read_item, value):
            # DCP's own version walks the flattened path with the keys turned into strings, which would put the
            # value of an optimizer's `state[0]` under a new key "0"; resolve the path against the real keys
            path = self.mappings.get(read_item.dest_index.fqn) if self.flatten_state_dict else None
            if path is None:
                return super().load_bytes(read_item, value)
            container = self.original_state_dict
            for part in path[:-1]:
                container = container[_real_key(container, part)]
            container[_real_key(container, path[-1])] = torch.load(value, weights_only=False)

    _PLANNERS = SavePlanner, LoadPlanner
    return _PLANNERS


_PLANNERS = None


# -- reading, with errors that name the file -------------------------------------------------------------------------
def _reader(path: Path):
    """A `FileSystemReader` of `path` whose read errors name the checkpoint and the file (see `_damaged`)."""
    global _READER
    if _READER is None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.futures import Future

        class _Reader(FileSystemReader):
            def read_metadata(self, *args, **kwargs):
                try:
                    return super().read_metadata(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - unpickling garbage (or another object) raises almost anything
                    raise _damaged(self.path, _METADATA, e) from e

            def read_data(self, plan, planner):
                # one file at a time, so that an error names its file
                by_file: dict[str, list] = {}
                for item in plan.items:
                    by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
                for name, items in by_file.items():
                    try:
                        super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                    except (EOFError, pickle.UnpicklingError, OSError, RuntimeError, AssertionError) as e:
                        if isinstance(e, (RuntimeError, AssertionError)) and not _UNREADABLE.search(str(e)):
                            raise  # not a damaged file
                        raise _damaged(self.path, name, e, self._ends(name)) from e
                done: Future = Future()
                done.set_result(None)
                return done

            def _ends(self, name: str) -> int:
                """The size `name` must have: the end of the last item stored in it."""
                return max((info.offset + info.length for info in self.storage_data.values()
                            if info.relative_path == name), default=0)

        _READER = _Reader
    return _READER(str(path))


_READER = None
# torch.load's words for a shard that is not a complete zip archive, and DCP's for a chunk of the wrong size
_UNREADABLE = re.compile(r"PytorchStreamReader|miniz|zip archive|mismatch sizes")


def _damaged(root, name: str, error: BaseException, size: int | None = None) -> CheckpointError:
    """The error for a checkpoint file that cannot be read: missing, shorter than `size`, or corrupted."""
    file = Path(root) / name
    if not file.exists():
        what = "is missing"
    elif size and file.stat().st_size < size:
        what = f"is truncated ({file.stat().st_size:,} of {size:,} bytes)"
    else:
        what = "is corrupted"
    return CheckpointError(f"cannot read the checkpoint at {str(root)!r}: its file {name!r} {what} "
                           f"({type(error).__name__}: {_first_sentence(error)}); the checkpoint is damaged (an "
                           f"interrupted copy or a full disk?): load an earlier one")


def _first_sentence(error: BaseException) -> str:
    return (str(error) or "end of file").split(". ")[0]


def __getattr__(name: str):
    # the planner classes subclass DCP's, which is imported on first use only
    if name == "SavePlanner":
        return _planner_classes()[0]
    if name == "LoadPlanner":
        return _planner_classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _real_key(container, part):
    if isinstance(container, Mapping):
        if part in container:
            return part
        for key in container:
            if str(key) == part:
                return key
        return part
    return int(part)


def _overlaps(local: torch.Tensor) -> bool:
    """True when several elements of `local` share memory (e.g. an expanded replicated component)."""
    return torch._debug_has_internal_overlap(local) != 0


def _kind(md) -> str:
    return "tensor" if hasattr(md, "chunks") else "non-tensor value"


def _check_against(flat: dict, metadata, strict: bool = True, path: str | None = None) -> None:
    """Every template entry must be in the checkpoint, with the same global shape; raises naming the entry."""
    saved = metadata.state_dict_metadata
    where = f" at {path!r}" if path else ""
    missing = [fqn for fqn in flat if fqn not in saved]
    if missing and strict:
        raise KeyError(f"the checkpoint{where} has no entry {missing[0]!r}"
                       + (f" (nor {missing[1:]})" if len(missing) > 1 else "")
                       + f" that the state dict to load into has; it has {len(saved)} entries, e.g. "
                       f"{sorted(saved)[:8]}")
    for fqn, value in flat.items():
        md = saved.get(fqn)
        if md is None:
            continue
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor != hasattr(md, "chunks"):
            raise ValueError(f"{fqn!r}: the checkpoint{where} holds a {_kind(md)} but the state dict to load into "
                             f"holds {'a tensor' if is_tensor else 'a value of type ' + type(value).__name__}")
        if is_tensor and tuple(md.size) != tuple(value.shape):
            raise ValueError(f"{fqn!r}: the checkpoint{where} holds a tensor of shape {list(md.size)}, but the "
                             f"state dict to load into has shape {list(value.shape)}")


# -- modules and optimizers -----------------------------------------------------------------------------------------
def _is_stateful(value) -> bool:
    """An object saved as its `state_dict()` and restored with `load_state_dict()`: an `nn.Module`, an optimizer, an
    LR scheduler... (DCP's `Stateful`); not a dict or a tensor."""
    return (not isinstance(value, (Mapping, torch.Tensor)) and callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None)))


def _plain(state_dict: dict, on_load: list | None = None, metadata=None, prefix: tuple = ()) -> dict:
    """A shallow copy of `state_dict` (nested dicts) with modules, optimizers and other stateful objects replaced
    by their state dicts.

    For a load, `on_load` collects `(object, template)` pairs to restore afterwards, and an optimizer's template
    is completed from `metadata` with the entries it does not have yet (a fresh optimizer has no state)."""
    out = {}
    for key, value in state_dict.items():
        path = prefix + (str(key),)
        if _is_stateful(value):
            value_sd = value.state_dict()
            if on_load is not None:
                if isinstance(value, torch.optim.Optimizer):
                    value_sd = _optimizer_template(value, value_sd, metadata, path)
                on_load.append((value, value_sd))
        elif isinstance(value, Mapping):
            value_sd = _plain(value, on_load, metadata, path)
            if on_load is not None and isinstance(value, MutableMapping):
                on_load.append((value, value_sd))
        else:
            value_sd = value
        out[key] = value_sd
    return out


def _optimizer_template(optimizer, template: dict, metadata, path: tuple) -> dict:
    """`optimizer.state_dict()` with an entry for every saved value it lacks: for the state of a parameter, a tensor
    of the saved shape and dtype (laid out like its parameter when it has the parameter's shape, except `step`);
    for a param group (e.g. an LR scheduler's `initial_lr`) or a non-tensor value, a placeholder that DCP
    replaces with the saved value."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: dict(entries) for index, entries in template["state"].items()}
    template = {**template, "state": state}
    planner_data = getattr(metadata, "planner_data", None) or {}
    head = len(path)
    for fqn, md in metadata.state_dict_metadata.items():
        saved_path = planner_data.get(fqn)
        if saved_path is None or len(saved_path) != head + 3 or tuple(map(str, saved_path[:head])) != path:
            continue
        section, index, name = str(saved_path[head]), int(saved_path[head + 1]), saved_path[head + 2]
        if section == "param_groups":
            groups = template.get("param_groups", [])
            if index < len(groups) and name not in groups[index]:
                groups[index][name] = None
            continue
        if section != "state" or index >= len(params) or name in state.get(index, {}):
            continue
        if index >= len(params) or name in state.get(index, {}):
            continue
        param = params[index]
        if not hasattr(md, "chunks"):
            value = None
        elif name != "step" and tuple(md.size) == tuple(param.shape):
            with torch.no_grad():
                value = torch.zeros_like(param, dtype=md.properties.dtype)
        else:
            device = param._layout.mesh.torch_device if isinstance(param, DTensor) else param.device
            value = torch.zeros(tuple(md.size), dtype=md.properties.dtype, device=device)
        state.setdefault(index, {})[name] = value
    return template


def _restore(on_load: list) -> None:
    """Writes what DCP loaded into the template copies back: values into the user's dicts (nested dicts stay the
    user's objects, tensors were filled in place), state dicts into modules and optimizers."""
    for target, loaded in on_load:
        if isinstance(target, MutableMapping):
            for key, value in loaded.items():
                current = target.get(key)
                if not (_is_stateful(current) or isinstance(current, MutableMapping)):
                    target[key] = value
        else:
            target.load_state_dict(loaded)


# -- coordination between clients ----------------------------------------------------------------------------------
class _Clients:
    """Rank 0 decides names and renames; with no process group everything is this process."""

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.is_coordinator = self.dist is None or self.dist.get_rank() == 0
        self.rank = 0 if self.dist is None else self.dist.get_rank()
        self.size = 1 if self.dist is None else self.dist.get_world_size()

    def broadcast(self, value):
        if self.dist is None:
            return value
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def outcomes(self, error: BaseException | None) -> dict[int, str]:
        """Every client's error (`Type: message`) by rank, for the clients that failed; also a barrier. Raises
        when a client cannot be reached (it died or stalled)."""
        mine = None if error is None else f"{type(error).__name__}: {error}"[:2000]
        if self.dist is None:
            return {} if mine is None else {0: mine}
        results = [None] * self.size
        self.dist.all_gather_object(results, mine)
        return {rank: e for rank, e in enumerate(results) if e is not None}

    def start(self, boundary: str) -> None:
        """Before `boundary` (a save or a load): with SPMD_CHECK_COLLECTIVES, checks that every client starts it."""
        if self.dist is not None:
            check_boundary(boundary)

    @staticmethod
    def lost(what: str, path, error: BaseException) -> CollectiveError:
        """The error to raise when the other clients could not be reached during `what`."""
        return unreachable(f"spmd.checkpoint.{what} of {str(path)!r}", error)


class _dcp_call(warnings.catch_warnings):
    """Runs a DCP call: without its warning that no process group is initialised (that is the single-process
    mode spmd means), and with the error of the lowest failing rank raised instead of DCP's
    `CheckpointException`, which is a `BaseException` that `except Exception` would not catch."""

    def __enter__(self):
        super().__enter__()
        warnings.filterwarnings("ignore", message=".*torch.distributed is .*(unavailable|uninitialized).*")

    def __exit__(self, kind, error, traceback):
        super().__exit__(kind, error, traceback)
        failures = getattr(error, "failures", None)
        if type(error).__name__ == "CheckpointException" and failures:
            raise failures[min(failures)][0] from error
        return False


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_checkpoint(path) -> bool:
    """True when `path` is a complete checkpoint directory (DCP's metadata file is written last)."""
    return (Path(path) / _METADATA).is_file()


# -- the API ---------------------------------------------------------------------------------------------------------
def save(state_dict: dict, path) -> None:
    """Saves `state_dict` as a DCP checkpoint directory at `path` (replacing a checkpoint already there).

    `state_dict` is a (nested) dict of DTensors, plain tensors, `nn.Module`s, optimizers and other objects with
    `state_dict()`/`load_state_dict()` (saved as their `state_dict()`), and other picklable values (ints, floats,
    lists...). Keys are flattened with dots as DCP does (`{"model": {"fc.weight": w}}` is saved as
    `model.fc.weight`).

    Every distinct shard of a DTensor is written once, by the client holding its first replica; with several
    processes (an initialised `torch.distributed` process group) each writes the shards of its own devices.
    The checkpoint is written into a hidden directory next to `path` and renamed to `path` only once complete:
    a save that fails or is interrupted leaves no `path` (nor, when it fails, the temporary directory), and a
    checkpoint already at `path` is only replaced by a complete one. The temporary directories of earlier saves
    of `path` that were killed are removed once stale (see the module's docstring).

    Raises:
      FileExistsError: `path` exists and is not a checkpoint (it is never overwritten).
    """
    dcp = _dcp()
    SavePlanner, _ = _planner_classes()
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"save expects a dict (state_dict), got {type(state_dict).__name__}")
    path = Path(path)
    if path.exists() and not is_checkpoint(path):
        raise FileExistsError(f"{path} exists and is not a checkpoint; spmd.checkpoint.save will not overwrite it")
    plain = _plain(state_dict)
    session = _controller_session(plain)
    if session is not None:  # controller DTensors: their workers write the shards (spmd/controller/checkpoint.py)
        return session.checkpoint_save(plain, path)
    clients = _Clients()
    clients.start(CHECKPOINT_SAVE)
    try:
        token = clients.broadcast(_token() if clients.is_coordinator else None)
    except RuntimeError as e:
        if lost_peer(e):
            raise clients.lost("save", path, e) from e
        raise
    tmp = path.parent / f".{path.name}.tmp-{token}"
    path.parent.mkdir(parents=True, exist_ok=True)
    error = None
    try:
        with _dcp_call():
            dcp.save(plain, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                     planner=SavePlanner())
        if clients.is_coordinator:
            _publish(tmp, path, token)
            _remove_stale(path)
    except BaseException as e:  # noqa: BLE001 - reported below, after the clients agree on the outcome
        error = e
    # every client learns whether all succeeded (this is also the barrier after the rename: when save returns,
    # `path` is complete on every client)
    try:
        failed = clients.outcomes(error)
        unreachable = None
    except Exception as e:  # noqa: BLE001 - a client died or stalled
        failed, unreachable = {}, e
    if failed or unreachable is not None or error is not None:
        # nothing was published (the coordinator renames only after every client wrote its shards); removing the
        # temporary directory is safe from any client
        shutil.rmtree(tmp, ignore_errors=True)
        if unreachable is not None and not isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise clients.lost("save", path, error or unreachable) from (error or unreachable)
        if error is not None:
            raise error
        first = min(failed)
        raise RuntimeError(f"client {clients.rank} of {clients.size}: spmd.checkpoint.save of {str(path)!r} failed "
                           f"on client(s) {sorted(failed)}; no checkpoint was written. Client {first}: "
                           f"{failed[first]}")


def _publish(tmp: Path, path: Path, token: str) -> None:
    """Renames the complete checkpoint `tmp` to `path`; a checkpoint already there is moved aside first and
    deleted after (restored if the rename fails), so `path` is only ever absent or a complete checkpoint."""
    if not is_checkpoint(tmp):
        raise RuntimeError(f"DCP finished without writing {tmp / _METADATA}")
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{token}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None and not path.exists():
            os.rename(old, path)
        raise
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _token() -> str:
    """HOST-PID-ID, naming a save's temporary directory: a later save can tell that the process is gone."""
    return f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


_HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _remove_stale(path: Path) -> None:
    """Removes what killed saves of `path` left next to it (`.NAME.tmp-*`, and `.NAME.old-*` of a save killed
    while it replaced a checkpoint) once stale: the process that wrote it, on this host, is gone, or nothing in
    it changed for `SPMD_CHECKPOINT_STALE_AFTER` seconds."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?:tmp|old)-(?:([0-9a-f]{{8}})-(\d+)-)?[0-9a-f]+")
    stale_after = float(os.environ.get("SPMD_CHECKPOINT_STALE_AFTER", 3600))
    for entry in path.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match is None or not entry.is_dir():
            continue
        host, pid = match.groups()
        gone = host == _HOST and not _alive(int(pid))
        if gone or time.time() - _last_change(entry) > stale_after:
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's process
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return True


def _last_change(directory: Path) -> float:
    """The newest modification time of `directory` and its files."""
    times = [directory.stat().st_mtime]
    with os.scandir(directory) as entries:
        times += [e.stat(follow_symlinks=False).st_mtime for e in entries]
    return max(times)


def load(state_dict: dict, path, *, strict: bool = True) -> None:
    """Loads the checkpoint at `path` into `state_dict` in place, each tensor in its own layout.

    `state_dict` is a template like the one saved: DTensors (any mesh, layout and number of devices; each
    device reads only the saved pieces of its own shard), plain tensors (filled with the global value),
    `nn.Module`s, optimizers, LR schedulers (restored with `load_state_dict`; a fresh optimizer gets its state
    tensors from the checkpoint, laid out like their parameters), and other values, which are replaced by the
    saved ones. Entries of the checkpoint that the template does not have are ignored.

    Raises:
      FileNotFoundError: no complete checkpoint at `path`.
      CheckpointError: a file of the checkpoint is missing, truncated or corrupted (naming the checkpoint and it).
      KeyError: (with `strict`) an entry of `state_dict` that the checkpoint lacks, named by its dotted key.
      ValueError: a tensor whose shape differs from the saved one (naming it and both shapes), or a tensor where
        a non-tensor value was saved and vice versa.
    """
    dcp = _dcp()
    _, LoadPlanner = _planner_classes()
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load expects a dict (state_dict), got {type(state_dict).__name__}")
    path = Path(path)
    if not is_checkpoint(path):
        what = "does not exist" if not path.exists() else f"has no {_METADATA} file (not a complete checkpoint)"
        raise FileNotFoundError(f"no checkpoint at {path}: it {what}")
    reader = _reader(path)
    metadata = reader.read_metadata()
    on_load: list = []
    template = _plain(state_dict, on_load, metadata)
    flat, mappings = flatten_state_dict(template)
    _check_against(flat, metadata, strict, str(path))
    session = _controller_session(flat)
    if session is not None:  # controller DTensors: their workers read the shards (spmd/controller/checkpoint.py)
        session.checkpoint_load(flat, mappings, template, path, strict)
    else:
        _load_here(dcp, template, reader, LoadPlanner(allow_partial_load=not strict), path)
    _restore(on_load + [(state_dict, template)] if isinstance(state_dict, MutableMapping) else on_load)


def _load_here(dcp, template: dict, reader, planner, path: Path) -> None:
    """DCP's load of `template` by this process (and the other clients, with a process group)."""
    clients = _Clients()
    clients.start(CHECKPOINT_LOAD)
    try:
        with _dcp_call():
            dcp.load(template, storage_reader=reader, planner=planner)
    except RuntimeError as e:
        if clients.dist is not None and lost_peer(e):
            raise clients.lost("load", path, e) from e
        raise


def _controller_session(state):
    """The session of the single-controller mesh (spmd.controller) of the first DTensor in `state` (nested dicts,
    lists, tuples) that has one: its workers hold the components. None when there is none."""
    if isinstance(state, DTensor):
        return state._layout.mesh.remote
    children = state.values() if isinstance(state, Mapping) else state if isinstance(state, (list, tuple)) else ()
    for child in children:
        session = _controller_session(child)
        if session is not None:
            return session
    return None
