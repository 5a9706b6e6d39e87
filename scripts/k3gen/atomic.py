"""Large files written whole or not at all (issue 47, item 6): each goes to a temporary name in
its directory (``.NAME.PID.tmp``), renamed into place once complete; an exception — a
KeyboardInterrupt (SIGINT), or SIGTERM once :func:`terminate_as_exception` made it one —
removes it; and :func:`remove_stale` removes the temporaries a writer that no longer runs
(killed with SIGKILL, a machine that went down) left behind. The names are the Rust writers'
(``k3_store::runtime::trunk::temp_name``)."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import sys

_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.tmp$")


def temp_name(path: str) -> str:
    """The temporary name of ``path`` while this process writes it."""
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}.{os.getpid()}.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: str) -> list[str]:
    """Remove every ``.NAME.PID.tmp`` in ``directory`` whose PID is not a live process; the
    paths removed (a live writer's temporaries are kept, whoever it is)."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for f in names:
        m = _TEMP.match(f)
        if m and int(m["pid"]) > 0 and not _alive(int(m["pid"])):
            p = os.path.join(directory, f)
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
                removed.append(p)
    return removed


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb"):
    """Open a temporary file for ``path``; on leaving the block normally it is flushed, synced
    and renamed to ``path``, on any exception removed (and the exception re-raised)."""
    tmp = temp_name(path)
    f = None
    try:
        # Opened inside the block: a signal that lands between the file's creation and the
        # block's start would otherwise leave the temporary behind.
        f = open(tmp, mode)
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
    except BaseException:
        if f is not None:
            f.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def terminate_as_exception() -> None:
    """Make SIGTERM raise ``SystemExit(1)`` like SIGINT raises KeyboardInterrupt, so the
    ``atomic_write`` blocks of a terminated writer remove their temporaries."""
    def handler(signum, frame):
        print(f"{os.path.basename(sys.argv[0])}: terminated (SIGTERM); removing temporary files",
              file=sys.stderr)
        raise SystemExit(1)
    signal.signal(signal.SIGTERM, handler)
