"""Leave a process without the interpreter's teardown.

A process that has imported torch and transformers spends ~1.1 s in Python's finalization after
its last line (freeing every module's objects; measured on a 2-core Xeon, where `os._exit` after
the same work took 0.03 s). The launcher waits for its children and a rollout side for its servers,
so a run paid that second once per level. `exit_now` does what the interpreter's exit does before the
teardown: it joins the threads that are not daemons (and runs the thread pools' exit hooks), runs what
was registered with `atexit` (logging's flush and close, process groups' close, multiprocessing's joins)
and flushes stdout and stderr; then it ends the process with `code`. Everything a process writes is
written; only the freeing of memory the process gives back anyway is skipped.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading


def exit_now(code: int | None) -> None:
    code = 0 if code is None else code
    if threading.current_thread() is threading.main_thread():
        # already leaving: a SIGTERM or SIGINT now (a starter stopping its children at the moment one exits)
        # ends the exit at once. Left to the process's handler it raised KeyboardInterrupt inside an exit
        # hook, and Python printed "Exception ignored in atexit callback" with a traceback on the stderr
        # the process shares with the command (seen in make test: async_rl/launch/procs.py:_interrupt in torch's
        # library finalizer).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: os._exit(code))
    try:
        threading._shutdown()  # what Py_FinalizeEx runs first (CPython 3.11-3.13)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed or replaced: nothing to flush
                pass
        os._exit(code)
