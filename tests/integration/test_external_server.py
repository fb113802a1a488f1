"""External generation servers (SGLang, vLLM) under their guard: tracked from spawn, never orphaned.

The "server" here is a real program standing in for SGLang (`engine.python` pointed at a shell
script): it writes its pid and then never becomes healthy, as a real engine does for minutes while
it loads. The launcher is the real one (`async_rl.launch.sglang_server.start_sglang` through
`async_rl.launch.rollout_proc.start_servers`, in a real starter process). What used to go wrong: the server
was tracked only once healthy, so a starter interrupted during those minutes left it running,
holding its GPU; and under Ray a dead server crashed the supervisor (its process had no `name`).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from async_rl.config import load_config
from async_rl.launch.external_server import Starting, start_guarded, wait_healthy
from async_rl.launch.procs import child_error, stop_all
from tests.e2e.test_run import DEBUG

ROOT = Path(__file__).resolve().parents[2]


def fake_engine(tmp_path: Path) -> Path:
    """An `engine.python` that records its pid and sleeps, never serving (a real engine loading for minutes)."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/server.pid\nexec sleep 600\n")
    script.chmod(0o755)
    return script


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_until(what, cond, limit_s: float = 120.0) -> None:
    """Poll `cond` (a liveness bound, far beyond what it needs: only a process that never goes trips it)."""
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.1)


STARTER = textwrap.dedent("""
    import signal, sys
    from async_rl.config import load_config
    from async_rl.placement import GpuSlot
    from async_rl.launch.rollout_proc import start_servers
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    cfg = load_config(sys.argv[1], sys.argv[2:])
    try:
        start_servers(cfg, [GpuSlot(visible=None, device="cpu")] * cfg.rollout.num_servers)
    except KeyboardInterrupt:
        sys.exit(130)
    """)


def start_starter(tmp_path: Path) -> subprocess.Popen:
    fake = fake_engine(tmp_path)
    return subprocess.Popen([sys.executable, "-c", STARTER, DEBUG, f"run_dir={tmp_path}", "engine.backend=sglang",
                             "model.name=/models/x", f"engine.python={fake}", "engine.start_timeout_s=600"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_starter_stopped_mid_start_leaves_no_server_running(tmp_path, how):
    starter = start_starter(tmp_path)
    pid_file = tmp_path / "server.pid"
    wait_until("the server never started", lambda: pid_file.is_file() and pid_file.read_text().strip())
    server = int(pid_file.read_text())
    assert alive(server)
    starter.send_signal(how)
    starter.wait(60)
    wait_until(f"the server outlived its starter ({how.name})", lambda: not alive(server))
    if how == signal.SIGTERM:
        assert starter.returncode == 130


def test_a_server_that_exits_is_one_error_naming_it_and_the_end_of_its_log(tmp_path):
    cfg = load_config(DEBUG, [f"run_dir={tmp_path}"])
    starting = Starting()
    proc = start_guarded(cfg, "server1", ["sh", "-c", "echo 'CUDA out of memory'; exit 3"], {}, starting,
                         what="engine.backend=sglang: server 1")
    assert starting.procs == [proc] and proc.name == "server1"  # what the Ray host's poll reads
    with pytest.raises(RuntimeError, match=r"server 1: .*exited with code 3.*CUDA out of memory"):
        wait_healthy(cfg, proc, "http://127.0.0.1:9", starting, what="engine.backend=sglang: server 1",
                     timeout_s=600)
    assert proc.exitcode == 2 and "exited with code 3" in child_error(cfg, proc.name, proc)
    stop_all([proc])


def test_each_server_process_stays_beside_its_url_whatever_order_they_spawn_in(tmp_path, monkeypatch):
    """The rollout side pairs server i's process with urls[i] (the keeper restarts, the pool fences by index).
    Servers start at once, so on a loaded machine server 1 can spawn before server 0: the processes handed
    back must still be in index order (spawn order swapped them, and a fresh-clone make test under load saw
    the keeper blame the live server for the killed one's death)."""
    import asyncio
    import json
    import multiprocessing

    from async_rl.launch import rollout_proc, servers
    from async_rl.placement import GpuSlot

    def launch(cfg, index, env, starting):
        if index == 0:
            starting.sleep(1.0)  # server 1 spawns first
        proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), name=f"server{index}")
        proc.start()
        return starting.track(proc), f"http://127.0.0.1:{9000 + index}"

    monkeypatch.setitem(servers.SERVER_LAUNCHERS, "embedded", launch)
    cfg = load_config(DEBUG, [f"run_dir={tmp_path}", "rollout.num_servers=2"])
    procs: list = []
    try:
        urls = asyncio.run(rollout_proc._start_servers(cfg, [GpuSlot(visible=None, device="cpu")] * 2, procs))
        assert urls == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
        assert [p.name for p in procs] == ["server0", "server1"]
        listing = json.loads((tmp_path / "servers.json").read_text())
        assert [(e["url"], e["pid"]) for e in listing] == [(u, p.pid) for u, p in zip(urls, procs)]
    finally:
        stop_all(procs)
