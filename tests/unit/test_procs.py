"""Children come from one warm fork server (async_rl/launch/procs.py): they start with its modules imported,
a child's own children come from the same server, and none outlives the process that started it,
although its OS parent (the fork server) lives on."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from async_rl.config import Config, load_config
from async_rl.launch.procs import spawn
from tests.e2e.clitools import running

ROOT = Path(__file__).resolve().parents[2]


def _cfg(run_dir: Path) -> Config:
    return load_config(None, [f"run_dir={run_dir}"])


def _report(cfg: Config, out: str, nested: bool = False) -> None:
    """Write this process's OS parent and whether the trainer's module (which neither this module nor
    async_rl.launch.procs imports) was already loaded when it started; with `nested`, start a child of its own
    that does the same, and wait for it."""
    lines = [f"{os.getppid()} {'async_rl.launch.trainer_proc' in sys.modules}"]
    if nested:
        child = spawn("grandchild", f"{__name__}:_report", cfg, out=out + ".child")
        child.join(60)
        lines.append(Path(out + ".child").read_text())
    Path(out).write_text("\n".join(lines))


def _sleep_forever(cfg: Config, out: str) -> None:
    Path(out).write_text(str(os.getpid()))
    while True:
        time.sleep(1.0)


def test_a_child_starts_warm_and_its_own_children_come_from_the_same_fork_server(tmp_path):
    cfg = _cfg(tmp_path)
    proc = spawn("child", f"{__name__}:_report", cfg, out=str(tmp_path / "r"), nested=True)
    proc.join(120)
    assert proc.exitcode == 0
    child, grandchild = [line.split() for line in (tmp_path / "r").read_text().splitlines()]
    assert child[1] == "True" and grandchild[1] == "True"  # forked from a server that had imported PRELOAD
    assert child[0] != str(os.getpid())  # the fork server is the OS parent, not this process
    assert grandchild[0] == child[0]  # the child asked the same server, it did not start one of its own


def test_a_fork_server_killed_ends_its_children_and_the_next_start_gets_a_new_one(tmp_path):
    """Its children die with it: one left running would look dead (exit 255) to its starter, which would
    start a second copy beside it."""
    cfg, out = _cfg(tmp_path), tmp_path / "pid"
    proc = spawn("sleeper", f"{__name__}:_sleep_forever", cfg, out=str(out))
    deadline = time.monotonic() + 60
    while not (out.is_file() and out.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(out.read_text())
    server = int(Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[1])
    os.kill(server, signal.SIGKILL)
    proc.join(30)
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child), "a child outlived its fork server"
    again = spawn("child", f"{__name__}:_report", cfg, out=str(tmp_path / "r"))
    again.join(120)
    assert again.exitcode == 0 and (tmp_path / "r").read_text().split()[0] != str(server)


def test_a_child_stops_when_the_process_that_started_it_is_killed(tmp_path):
    """The starter is SIGKILLed; its child's OS parent (the fork server) stays alive as long as the child
    holds it, so only watching the starter itself ends the child."""
    out = tmp_path / "pid"
    code = ("import sys, time; from tests.unit.test_procs import _cfg, spawn; from pathlib import Path; "
            f"spawn('sleeper', 'tests.unit.test_procs:_sleep_forever', _cfg(Path({str(tmp_path)!r})), out={str(out)!r}); "
            "time.sleep(600)")
    starter = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (out.is_file() and out.read_text()) and time.monotonic() < deadline:
            assert starter.poll() is None
            time.sleep(0.1)
        child = int(out.read_text())
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        deadline = time.monotonic() + 30
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(child), "the child outlived the process that started it"
    finally:
        starter.kill()
        if out.is_file() and out.read_text() and running(int(out.read_text())):
            os.kill(int(out.read_text()), signal.SIGKILL)


def test_what_the_fork_server_imports_touches_no_cuda():
    """A child forked from a process that initialised CUDA cannot use it: importing `PRELOAD` must not ask
    CUDA anything (here every CUDA query raises; a module that asks at import fails to load)."""
    code = ("import torch\n"
            "def refuse(*a, **k): raise RuntimeError('CUDA asked at import')\n"
            "for name in ('is_available', 'device_count', 'init', '_lazy_init', 'get_device_properties',"
            " 'current_device', 'mem_get_info', 'is_bf16_supported'):\n"
            "    setattr(torch.cuda, name, refuse)\n"
            "import importlib\n"
            "from async_rl.launch.procs import PRELOAD\n"
            "for m in PRELOAD: importlib.import_module(m)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
