"""The command line answers bad input with one clear line and exit code 2, never a traceback or a hang."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr
    assert needle in errors[0], errors[0]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("args,needle", [
    (["run", "--config", "configs/nope.yaml"], "config file not found: configs/nope.yaml"),
    (["run", "--config", DEBUG, "trainer.bogus=1"], "trainer.bogus: unknown key"),
    (["run", "--config", DEBUG, "total_steps=many"], "total_steps"),
    (["run", "--config", DEBUG, "mode=turbo"], "mode: must be one of async|sync"),
    (["train", "--config", DEBUG], "transport.addr"),
])
def test_config_mistakes(args, needle, tmp_path):
    assert_one_line_error(cli(*args, f"run_dir={tmp_path}" if "nope" not in args[2] else "x=1"), needle)


def test_unreachable_generation_server(tmp_path):
    res = cli("rollout", "--config", DEBUG, f"run_dir={tmp_path}", "transport.addr=tcp://127.0.0.1:9",
              "rollout.server_addrs=[http://127.0.0.1:9]", "rollout.connect_timeout_s=2")
    assert_one_line_error(res, "http://127.0.0.1:9")


def test_unreachable_trainer(tmp_path):
    res = cli("rollout", "--config", DEBUG, f"run_dir={tmp_path}", "transport.addr=tcp://127.0.0.1:9",
              "rollout.connect_timeout_s=3")
    assert_one_line_error(res, "tcp://127.0.0.1:9")
