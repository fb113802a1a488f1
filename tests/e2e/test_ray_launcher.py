"""`async-rl run ... launcher=ray` on real local Ray clusters, as a user runs it.

One cluster is started here with `ray start --head --block` (2 CPUs, no dashboard, a small
object store) and joined with `ray.address=`; the launcher must leave it running and free
its bundles. Another run starts (and must stop) its own local cluster.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from launch.common import free_port

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
RAY_NOISE = re.compile(r"raylet|gcs_server|core_worker|\(pid=|\bINFO\b.*\bray\b|usage stats|ray\.init", re.I)
FAST = ["log.progress=false", "rollout.connect_timeout_s=30", "model.dtype=float32", "trainer.compute_dtype=float32",
        "task.eval_size=16"]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def raylets() -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"/raylet/raylet" in (d / "cmdline").read_bytes():
                    out.add(int(d.name))
            except OSError:
                pass
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A 2-CPU Ray head on 127.0.0.1, stopped (by its own pid) after the module."""
    port = free_port()
    log = (tmp_path_factory.mktemp("ray") / "ray_start.log").open("w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                             f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                             "--include-dashboard=false", "--object-store-memory=80000000", "--disable-usage-stats"],
                            env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not listening("127.0.0.1", port):
            assert proc.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` drains and stops what it started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def free_cpus(address: str) -> float:
    """The cluster's free CPUs once every placement group of ours is gone (or after 20 s)."""
    ray.init(address=address, log_to_driver=False, logging_level="ERROR", namespace="async_rl_test")
    try:
        deadline = time.monotonic() + 20
        while True:
            cpus = ray.available_resources().get("CPU", 0.0)
            if cpus >= 2 or time.monotonic() > deadline:
                return cpus
            time.sleep(0.5)
    finally:
        ray.shutdown()


def test_debug_run_on_a_local_cluster_it_starts_and_stops(tmp_path):
    before = raylets()
    steps = 3
    res = cli("run", "--config", DEBUG, "launcher=ray", f"run_dir={tmp_path}", f"total_steps={steps}", *FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["when"] for e in evals] == ["before", "after"]
    assert "ray: 3 bundles placed on a local Ray cluster" in res.stdout
    for name in ("server", "trainer", "rollout"):  # each process logged into the run directory
        assert (tmp_path / "logs" / f"{name}.log").is_file(), name
    noise = [line for line in (res.stdout + res.stderr).splitlines() if RAY_NOISE.search(line)]
    assert not noise, noise
    assert res.stderr.strip() == "", res.stderr[-2000:]
    assert raylets() <= before, "the local cluster the launcher started is still running"


def test_unplaceable_world_size_times_out_naming_resources(tmp_path, cluster):
    t0 = time.monotonic()
    res = cli("run", "--config", DEBUG, "launcher=ray", f"ray.address={cluster}", "trainer.world_size=4",
              "ray.placement_timeout_s=3", f"run_dir={tmp_path}", *FAST, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ray: cannot place 6 bundles"), res.stderr[-2000:]
    for part in ("4 trainer x (CPU 1", "CPU 5", "ray.placement_timeout_s=3s", "trainer.world_size", "CPU 2"):
        assert part in lines[0], (part, lines[0])
    assert time.monotonic() - t0 < 60
    # a joined cluster is left running, with the run's bundles given back
    assert free_cpus(cluster) == 2


def test_world_size_beyond_this_machine_fails_before_starting_a_cluster(tmp_path):
    res = cli("run", "--config", DEBUG, "launcher=ray", f"trainer.world_size={os.cpu_count() + 1}",
              f"run_dir={tmp_path}", *FAST, timeout=60)
    assert res.returncode == 2
    assert res.stderr.startswith("error: ray: cannot place") and "on this machine" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_failed_process_ends_the_run_naming_it_and_its_log(tmp_path, cluster):
    res = cli("run", "--config", DEBUG, "launcher=ray", f"ray.address={cluster}", "engine.kv_cache_mb=0.000001",
              f"run_dir={tmp_path}", *FAST, timeout=180)
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: server") and "engine.kv_cache_mb" in line, res.stderr[-2000:]
    assert f"(log: {tmp_path / 'logs'}" in line, line
    assert free_cpus(cluster) == 2


def test_sigterm_tears_everything_down_and_leaves_the_cluster(tmp_path, cluster):
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "--config", DEBUG, "launcher=ray",
                             f"ray.address={cluster}", "total_steps=500", f"run_dir={tmp_path}", *FAST],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text()):  # trainer, rollout and server are all working
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.5)
        server = re.search(r"serving \S+ on http://([\d.]+):(\d+)", (tmp_path / "logs" / "server.log").read_text())
        queue = (tmp_path / "trainer_address").read_text().strip()[len("tcp://"):].rsplit(":", 1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err
    assert not listening(server.group(1), int(server.group(2))), "generation server still serving"
    assert not listening(queue[0], int(queue[1])), "trainer still listening"
    assert free_cpus(cluster) == 2
