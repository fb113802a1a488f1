"""The recipes under launch/ (run_local.py, two_machines.py, ray_cluster.py): scripts run as files over the
package, as a user runs them. Each reaches the `async-rl` command line with the arguments it builds; the
runs themselves are tested through the command line (test_run.py, test_ray_launcher.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.clitools import ROOT

SCRIPTS = ["run_local.py", "two_machines.py", "ray_cluster.py"]


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launch" / name), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_recipe_runs_as_a_file_and_explains_itself(name):
    res = _script(name, "--help")
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout


def test_run_local_passes_its_config_and_overrides_on(tmp_path):
    res = _script("run_local.py", "--config", str(tmp_path / "none.yaml"))
    assert res.returncode == 2 and f"error: config file not found: {tmp_path / 'none.yaml'}" in res.stderr, res.stderr
    res = _script("run_local.py", "trainer.bogus=1")
    assert res.returncode == 2 and "error: trainer.bogus: unknown key" in res.stderr, res.stderr


def test_two_machines_points_both_sides_at_the_trainer_with_keys(tmp_path):
    """The side's command gets the queue address and the keys: an address other machines reach with no keys
    made is refused before anything starts, naming the key the recipe set."""
    keys = tmp_path / "keys"
    for side in ("train", "rollout"):
        res = _script("two_machines.py", side, "--host", "10.0.0.1", "--keys", str(keys), f"run_dir={tmp_path / side}")
        assert res.returncode == 2, res.stderr
        assert f"error: transport.curve_keys_dir: no directory '{keys}'" in res.stderr, res.stderr


def test_ray_cluster_passes_its_overrides_on():
    res = _script("ray_cluster.py", "--address", "127.0.0.1:1", "ray.bogus=1")
    assert res.returncode == 2 and "error: ray.bogus: unknown key" in res.stderr, res.stderr
