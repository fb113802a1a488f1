"""`exit_now` skips only the interpreter's teardown: what a process writes, its atexit hooks and the work
of its non-daemon threads all happen, and the exit code is kept."""

import subprocess
import sys

CHILD = r"""
import atexit, sys, threading, time
from pathlib import Path
from async_rl.utils.exits import exit_now
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.3)
    (out / "thread").write_text("done")
threading.Thread(target=late).start()  # not a daemon: the exit waits for it, as the interpreter's does
sys.stdout.write("buffered, no newline")
exit_now(3)
"""


def test_exit_now_keeps_output_atexit_hooks_threads_and_the_code(tmp_path):
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    assert res.stdout == "buffered, no newline"
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"


SIGNALLED = r"""
import atexit, os, signal, sys, time
from async_rl.utils.exits import exit_now

def interrupt(signum, frame):  # what async_rl/launch/procs.py installs in every child
    raise KeyboardInterrupt

signal.signal(signal.SIGTERM, interrupt)
def slow_hook():
    print("hook", flush=True)
    time.sleep(5)
atexit.register(slow_hook)
exit_now(3)
"""


def test_a_sigterm_during_the_exit_ends_it_quietly_with_the_code():
    """A starter stopping its children (SIGTERM) as one of them exits: the exit ends at once, with its own
    code and nothing on stderr. Before, the child's handler raised KeyboardInterrupt inside an exit hook
    and Python printed a traceback on the stderr the child shares with the command."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "hook\n"  # inside the exit hook now
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3 and err == "", (proc.returncode, err)
