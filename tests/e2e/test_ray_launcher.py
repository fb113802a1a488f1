"""`launcher=ray` on real local Ray clusters: the command line as a user runs it, the errors in process.

One cluster is started here with `ray start --head --block` (2 CPUs, no dashboard, a small
object store) and joined with `ray.address=`; the launcher must leave it running and give
its bundles back. The debug run starts (and must stop) its own local cluster.
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

from async_rl.config import load_config
from async_rl.trainer.checkpoint import latest_checkpoint
from async_rl.launch.common import free_port
from async_rl.launch.local import RunFailed
from async_rl.launch import ray_launcher
from async_rl.launch.ray_launcher import RayRun, run_ray

pytestmark = pytest.mark.alone  # make test runs these after the two-worker part, on their own

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
RAY_NOISE = re.compile(r"raylet|gcs_server|core_worker|\(pid=|\bINFO\b.*\bray\b|usage stats|ray\.init", re.I)
FAST = ["log.progress=false", "rollout.connect_timeout_s=30", "model.dtype=float32", "trainer.compute_dtype=float32",
        "task.eval_size=16", "trainer.batch_size=16"]


def config(run_dir: Path, *overrides: str):
    return load_config(DEBUG, ["launcher=ray", f"run_dir={run_dir}", *FAST, *overrides])


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "async_rl.launch.cli", *args], cwd=ROOT, capture_output=True, text=True,
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
    cfg = config(tmp_path, f"ray.address={cluster}", "trainer.backend=fsdp", "trainer.world_size=4",
                 "ray.placement_timeout_s=3")
    with pytest.raises(RuntimeError) as err:
        run_ray(cfg)
    msg = str(err.value)
    assert msg.startswith("ray: cannot place 6 bundles") and "\n" not in msg, msg
    for part in ("4 trainer x (CPU 1", "CPU 5", "ray.placement_timeout_s=3s", "trainer.world_size", "CPU 2"):
        assert part in msg, (part, msg)  # its timeout ended the wait (named), not a hang
    # a joined cluster is left running, with the run's bundles given back
    assert free_cpus(cluster) == 2


@pytest.mark.parametrize("backend,error,expected", [
    ("fsdp", RuntimeError, "ray: cannot place"), ("single", ValueError, "trainer.world_size: trainer.backend=single")])
def test_bad_world_size_fails_before_starting_a_cluster(tmp_path, backend, error, expected):
    before = raylets()
    with pytest.raises(error, match=re.escape(expected)):
        run_ray(config(tmp_path, f"trainer.backend={backend}", f"trainer.world_size={os.cpu_count() + 1}"))
    assert raylets() <= before


def test_unreachable_address_is_one_error_naming_the_key(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=f"ray.address: no Ray cluster answers at {address}"):
        run_ray(config(tmp_path, f"ray.address={address}"))


def test_failed_process_ends_the_run_naming_it_and_its_log(tmp_path, cluster):
    with pytest.raises(RunFailed) as err:
        run_ray(config(tmp_path, f"ray.address={cluster}", "engine.kv_cache_mb=0.000001"))
    msg = str(err.value)
    assert msg.startswith("server: ") and "engine.kv_cache_mb" in msg and "\n" not in msg, msg
    assert f"(log: {tmp_path / 'logs' / 'server.log'})" in msg, msg
    assert free_cpus(cluster) == 2


def test_two_trainer_ranks_train_then_sigterm_tears_everything_down(tmp_path, cluster):
    """Ranks 0 and 1 in their own bundles train in lock step; SIGTERM stops every process, frees the bundles."""
    proc = subprocess.Popen([sys.executable, "-m", "async_rl.launch.cli", "run", "--config", DEBUG, "launcher=ray",
                             f"ray.address={cluster}", "trainer.backend=fsdp", "trainer.world_size=2",
                             "ray.num_cpus_per_trainer=0.5", "total_steps=500", f"run_dir={tmp_path}", *FAST],
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
    assert "placed 4 bundles" in (tmp_path / "logs" / "launcher.log").read_text()
    assert (tmp_path / "logs" / "trainer1.log").is_file()  # rank 1 ran (in its own bundle) and took the step
    # rank 0 stopped first: it checkpointed the last step with rank 1, then told it to stop (stopped together,
    # rank 1 died under rank 0's last collectives and the teardown waited out the grace period)
    assert "trainer rank 1: stop after" in (tmp_path / "logs" / "trainer1.log").read_text()
    trained = len((tmp_path / "metrics.jsonl").read_text().splitlines())
    assert latest_checkpoint(tmp_path / "checkpoints").name == f"step_{trained:06d}"
    assert free_cpus(cluster) == 2


def test_an_actor_slow_to_answer_is_waited_for_a_silent_one_fails_in_time_a_dead_one_at_once(tmp_path, cluster,
                                                                                             monkeypatch):
    class _Host:  # defined here, so Ray ships it by value to its workers (the tests are not importable there)
        """Stands in for a ProcessHost: its poll answers after `slow_s` for the first `slow_calls` calls (a node
        busy loading a server), then at once."""

        def __init__(self, slow_s: float, slow_calls: int):
            self.slow_s, self.slow_calls = slow_s, slow_calls

        def poll(self):
            self.slow_calls -= 1
            if self.slow_calls >= 0:
                time.sleep(self.slow_s)
            return None, ""

    monkeypatch.setattr(ray_launcher, "ANSWER_S", 0.5)
    monkeypatch.setattr(ray_launcher, "SILENT_LIMIT_S", 3.0)
    ray.init(address=cluster, log_to_driver=False, logging_level="ERROR", namespace="async_rl_test")
    try:
        host = ray.remote(_Host).options(num_cpus=0, max_concurrency=4)
        run = RayRun(ray, config(tmp_path, f"ray.address={cluster}"), [])
        run.hosts = {"server": host.remote(1.5, 1)}
        ray.get(run.hosts["server"].__ray_ready__.remote())
        assert run._check() == {"server": None}  # one poll unanswered: waited for, not reported dead
        time.sleep(1.5)
        assert run._check() == {"server": None} and run.silent_since == {}  # it answered
        run.hosts = {"trainer": host.remote(5.0, 100)}
        t0 = time.monotonic()
        with pytest.raises(RunFailed, match=r"trainer: its Ray actor has not answered for \d+ s") as err:
            while time.monotonic() - t0 < 30:  # the actor stays silent 100 s: only SILENT_LIMIT_S ends this
                run._check()
        assert int(str(err.value).split("answered for ")[1].split()[0]) >= 3  # the limit, waited for in full
        run.hosts = {"rollout": host.remote(0.0, 0)}
        ray.kill(run.hosts["rollout"])
        t0 = time.monotonic()
        with pytest.raises(RunFailed, match="rollout: its Ray actor died"):
            while time.monotonic() - t0 < 30:
                run._check()
    finally:
        ray.shutdown()
