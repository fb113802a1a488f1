"""`async-rl run` / `train` + `rollout` end to end on the tiny debug config, as a user runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from async_rl.launch.common import free_port
from tests.e2e.admission import check_admission, gate_overrides

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")


def cli(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "async_rl.launch.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rollout_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollout_metrics.jsonl").read_text().splitlines()]


# at eta=4 the queue's default capacity (4 batches) would bound what is produced by itself: a larger
# one leaves the bound to the staleness gate, whose checks (admission.py) then fail without it; eta=1
# moves the weights over a torch.distributed group (gloo), the GPU path's transport; eta=4 is paced
# (rollout.pace: the trainer tells the rollout side what it found ready, and its gate moves within eta)
# and pauses its servers in_place for updates (rollout.pause_mode; what an in_place update does to the KV in
# flight is checked in tests/unit/test_engine_core.py: on this fast task few requests are in flight then)
@pytest.mark.parametrize("mode,eta,extra", [("async", 1, ["weight_sync.transport=dist"]),
                                            ("async", 4, ["transport.capacity=1024", "rollout.pace=true",
                                                          "rollout.pause_mode=in_place"]),
                                            ("sync", 0, ["task.val_size=1"])])
def test_run_completes_within_staleness_bound(tmp_path, mode, eta, extra):
    steps = 4
    res = cli("run", "--config", DEBUG, f"run_dir={tmp_path}", f"mode={mode}", f"max_staleness={eta}",
              f"total_steps={steps}", "log.progress=false", "rollout.eval_every=2", *extra, *gate_overrides())
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp_path / "restarts.jsonl").exists(), res.stderr[-3000:]  # nothing crashed and was restarted
    rows = metrics(tmp_path)
    check_admission(rows, rollout_metrics(tmp_path), eta=eta, batch=64)  # what was produced, arrived and dropped
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for key in ("train/reward_mean", "train/loss", "train/staleness_max", "train/dropped_stale",
                    "rollout/interrupted", "queue/depth", "timing/step_s", "train/entropy", "train/kl_init",
                    "train/kl_prev", "train/grad_norm_clipped", "train/zero_var_groups_frac",
                    "train/group_reward_means"):
            assert key in r, key
        assert r["train/staleness_max"] <= eta  # what was kept
    if "rollout.pace=true" in extra:
        assert rows[0]["queue/buffered_at_ask"] < 64  # the first batch is always waited for
        aheads = [r["rollout/ahead"] for r in rollout_metrics(tmp_path) if "rollout/ahead" in r]
        assert aheads and all(1 <= a <= eta for a in aheads), aheads
    if mode == "sync":
        assert all(r["rollout/interrupted"] == 0 for r in rows)
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["when"] for e in evals if e["when"] != "periodic"] == ["before", "after"]
    assert evals[-1]["policy_version"] == steps
    periodic = [e for e in evals if e["when"] == "periodic"]  # beside training, every 2 versions
    assert periodic and all(e["step"] % 2 == 0 and e["eval/version_min"] >= e["step"] for e in periodic)
    walls = [e["timing/train_wall_s"] for e in periodic]
    assert walls == sorted(walls) and walls[0] > 0
    assert (tmp_path / "config.yaml").is_file()
    audited = cli("audit", str(tmp_path), timeout=60)  # nothing produced was lost or trained twice
    assert audited.returncode == 0 and "lost=0 duplicated=0" in audited.stdout, audited.stdout + audited.stderr
    if mode == "sync":  # every checkpoint is also a plain Hugging Face model directory
        _loads_as_hf_model(tmp_path / "checkpoints" / f"step_{steps:06d}")
        _best_is_the_best_validated(tmp_path, evals, res.stdout)
    assert "greedy accuracy on 3 held-out problems" in res.stdout  # the debug task holds out 3 of its 9 sums
    # the summary's wall time is the wall clock from the first generation to the last step's end, and
    # no accuracy target is printed for a task whose config names none (task.eval_targets)
    started = next(r["time"] for r in rollout_metrics(tmp_path) if "rollout/generation_started" in r)
    assert f"wall time: {rows[-1]['time'] - started:.1f}s from the first generation" in res.stdout, res.stdout
    assert "time to accuracy" not in res.stdout


def test_dynamic_sampling_refills_and_the_audit_counts_what_it_filtered(tmp_path):
    """The tiny model starts near reward 0.15, so many groups of 8 are all wrong: they are set aside,
    released from the staleness count and replaced, every batch still trains B trajectories, and the
    audit accounts for every filtered id."""
    steps = 4
    res = cli("run", "--config", DEBUG, f"run_dir={tmp_path}", f"total_steps={steps}", "trainer.dynamic_sampling=true",
              "log.progress=false")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["train/num_trajectories"] == 64 for r in rows)
    filtered = sum(r["train/filtered_groups"] for r in rows)
    assert filtered > 0
    audited = cli("audit", str(tmp_path), timeout=60)
    assert audited.returncode == 0 and "lost=0 duplicated=0" in audited.stdout, audited.stdout + audited.stderr
    assert f"filtered={int(filtered) * 8} " in audited.stdout
    released = [json.loads(line).get("rollout/released", 0) for line in
                (tmp_path / "rollout_metrics.jsonl").read_text().splitlines()]
    assert max(released) > 0  # the rollout side's gate was told, so it admitted replacements


def test_train_and_rollout_started_separately(tmp_path):
    addr = f"tcp://127.0.0.1:{free_port()}"
    common = ["--config", DEBUG, f"transport.addr={addr}", "total_steps=3", "weight_sync.transport=zmq",
              "log.progress=false"]
    train = subprocess.Popen([sys.executable, "-m", "async_rl.launch.cli", "train", *common, f"run_dir={tmp_path / 't'}"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        roll = cli("rollout", *common, f"run_dir={tmp_path / 'r'}")
        out, err = train.communicate(timeout=120)
    finally:
        train.kill()
    assert roll.returncode == 0, roll.stderr[-3000:]
    assert train.returncode == 0, err[-3000:]
    assert len(metrics(tmp_path / "t")) == 3
    # the rollout side loaded weights it received over the queue into its own run directory
    assert list((tmp_path / "r" / "weights").glob("v*/model.safetensors"))  # a directory per version
    assert (tmp_path / "r" / "eval.jsonl").is_file()
    # the trainer's directory alone cannot vouch for what the rollout side produced: incomplete, exit 1
    alone = cli("audit", str(tmp_path / "t"), timeout=60)
    assert alone.returncode == 1 and "incomplete: no rollout ledger" in alone.stdout, alone.stdout + alone.stderr
    both = cli("audit", str(tmp_path / "t"), str(tmp_path / "r"), timeout=60)
    assert both.returncode == 0 and "lost=0 duplicated=0 lost_prompts=0" in both.stdout, both.stdout + both.stderr


def _best_is_the_best_validated(run_dir: Path, evals: list[dict], stdout: str) -> None:
    """run_dir/best is the first version with the highest validation accuracy of those evaluated (during
    training and after it), a Hugging Face model, and the summary names it and where it is."""
    assert "eval/val_accuracy" not in evals[0]  # the starting weights are no candidate: not scored on it
    scored = [e for e in evals if e["when"] in ("periodic", "after")]
    top = max(e["eval/val_accuracy"] for e in scored)
    chosen = next(e for e in scored if e["eval/val_accuracy"] == top)
    meta = json.loads((run_dir / "best" / "meta.json").read_text())
    assert meta["policy_version"] == chosen["policy_version"] and meta["chosen_on"] == "validation"
    assert meta["test_accuracy"] == chosen["eval/accuracy"] and chosen["eval/val_n"] == 1
    assert f"best version: v{meta['policy_version']}, validation accuracy" in stdout
    assert f"kept at {run_dir / 'best'}" in stdout
    _loads_as_hf_model(run_dir / "best")


def _loads_as_hf_model(ckpt: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    saved = load_file(str(ckpt / "model.safetensors"))
    state = model.state_dict()
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())
    assert tok.decode(tok.encode("1+2=")) == "1+2="
