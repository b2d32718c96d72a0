"""A watchdog for the processes a controller starts besides its workers (Ray's own daemons): if the controller
dies without shutting them down (killed, crashed), the reaper kills them and everything below them.

The reaper is a small separate process holding the read end of a pipe whose write end only the controller holds:
when the controller goes, in any way, the pipe closes. A controller that shuts down cleanly first writes `done`,
and the reaper leaves quietly. (Monarch's processes need none: they end with their controller.)

    python -m spmd.controller.reaper PID [PID ...]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

DONE = b"done\n"


def watch(pids: list[int]) -> subprocess.Popen:
    """Starts a reaper for `pids` (in its own session, so a signal to the controller's group spares it)."""
    return subprocess.Popen([sys.executable, "-m", "spmd.controller.reaper", *map(str, pids)],
                            stdin=subprocess.PIPE, start_new_session=True)


def release(reaper: subprocess.Popen) -> None:
    """The controller shut down cleanly: the reaper leaves without killing anything."""
    try:
        reaper.stdin.write(DONE)
        reaper.stdin.close()
    except (BrokenPipeError, ValueError):
        pass
    reaper.wait(timeout=10)


def tree(pids: list[int]) -> list[int]:
    """`pids` and every live process below them, zombies left out (Linux's /proc; elsewhere just `pids`)."""
    children: dict[int, list[int]] = {}
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        state, parent = f.read().rsplit(")", 1)[1].split()[:2]
                except (OSError, IndexError, ValueError):
                    continue
                if state != "Z":
                    children.setdefault(int(parent), []).append(int(entry))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def main(argv: list[str]) -> None:
    pids = [int(a) for a in argv]
    if sys.stdin.buffer.readline() == DONE:
        return
    for pid in tree(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    main(sys.argv[1:])
