"""Whether a process id names a running process (signal 0: nothing is sent)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while `pid` exists (a zombie not yet reaped included); a process of another user counts."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
