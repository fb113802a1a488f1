"""`async-rl sim` as a user runs it: calibrate on a real run made here, simulate it back, sweep, bad input."""

import json
from pathlib import Path

import pytest
import yaml

from async_rl.sim import Placement, load_profile, sim_config, simulate
from tests.e2e.clitools import ROOT, cli, cli_here

PROFILE = str(ROOT / "configs" / "sim" / "areal_h800_r1distill_1p5b.yaml")


@pytest.fixture
def run_dir(finished_run):
    return finished_run  # tests/e2e/conftest.py: 5 async steps at eta=1, pinned pools, batch 32, 6 new tokens


def test_calibration_round_trips_a_run(run_dir, tmp_path):
    out = tmp_path / "profile.yaml"
    res = cli("sim", "calibrate", str(run_dir), "--out", str(out), timeout=120)
    assert res.returncode == 0, res.stderr
    profile = load_profile(out)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert profile.response.samples == [n for r in rows for n in r["train/response_lens"]]
    assert profile.config["trainer.batch_size"] == 32 and profile.config["max_staleness"] == 1
    assert profile.config["rollout.max_new_tokens"] == 6 and profile.response.max == 6
    assert profile.measured["placement"] == {"kind": "pools", "rollout": 1, "trainer": 1}
    assert profile.engine.units == 1 and profile.trainer.units == 1  # pinned to one core each
    assert profile.engine.step_s(8, 8 * 8, 0) > 0 and profile.trainer.per_token_s > 0 and profile.sync.load_s > 0
    assert yaml.safe_load(out.read_text())["sources"][0].startswith("async-rl sim calibrate")
    # the calibrated profile, simulated with the run's own settings, lands near what the run measured
    result = simulate(profile, sim_config(profile), Placement.pools(1, 1))
    assert len(result.records) == 5
    measured = profile.measured["trained_traj_per_s"]
    assert measured / 2 < result.traj_per_s < measured * 2, (result.traj_per_s, measured)
    # a request's HTTP, stream and reward are measured and simulated: a profile without that cost (calibrated
    # before it was measured) runs ahead of the run. How far ahead depends on how loaded the measured machine
    # was (the steps slow down, the per-request cost less so): only the direction is a property of the code
    assert profile.measured["per_request_measured"] and profile.engine.per_request_s > 0
    profile.engine.per_request_s = 0.0
    assert simulate(profile, sim_config(profile), Placement.pools(1, 1)).traj_per_s > result.traj_per_s


def test_sweep_prints_a_table_draws_plots_and_recommends(tmp_path):
    res = cli("sim", "--profile", PROFILE, "--gpus", "64", "--eta", "0,2", "--split", "48:16,32:32", "--steps", "6",
              "--out", str(tmp_path), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "| 48:16 | async | 2 |" in res.stdout and "sync (colocated)" in res.stdout
    assert "recommended: split" in res.stdout
    assert (tmp_path / "sim.png").stat().st_size > 10_000 and (tmp_path / "sim.md").is_file()


@pytest.mark.parametrize("args,message", [
    (["sim", "--gpus", "8"], "error: --profile: required"),
    (["sim", "--profile", "nope.yaml", "--gpus", "8"], "error: --profile: no such file: nope.yaml"),
    (["sim", "--profile", PROFILE, "--gpus", "8", "--split", "6:6"], "error: --split: 6:6 needs"),
    (["sim", "--profile", PROFILE, "--gpus", "8", "--eta", "1,-2"], "error: --eta:"),
    (["sim", "--profile", PROFILE, "--gpus", "8", "--split", "shared"], "error: --split: nothing to simulate"),
    (["sim", "--profile", PROFILE, "--gpus", "8", "trainer.batch_size=abc"], "error: trainer.batch_size"),
    (["sim", "calibrate", "/nonexistent/run"], "error: /nonexistent/run: not a run directory"),
    (["sim", "calibrate"], "error: sim calibrate: expected a RUN_DIR"),
])
def test_bad_input_is_one_error_line(args, message):
    res = cli_here(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), res.stderr


def test_a_bad_profile_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    data = yaml.safe_load(Path(PROFILE).read_text())
    data["engine"] = {"warp_speed": 9}
    bad.write_text(yaml.safe_dump(data))
    res = cli_here("sim", "--profile", str(bad), "--gpus", "8")
    assert res.returncode == 2 and res.stderr.strip() == (
        "error: engine.warp_speed: unknown key (known: max_running, max_tokens_per_step, overlap_pools, "
        "overlap_shared, per_ctx_token_s, "
        "per_prefill_token_s, per_request_s, per_seq_s, scaling, step_base_s, units)")
