"""`async-rl sim calibrate` recovers known speeds from a run directory written with them."""

import json

import pytest

from async_rl.config import load_config, save_config
from async_rl.sim.calibrate import calibrate

BASE, PER_SEQ, PER_CTX, PER_PREFILL = 0.01, 0.002, 1e-5, 3e-4  # engine, on 1 thread
OVERHEAD, PER_TOKEN, SCALING = 0.5, 0.001, 0.8  # trainer, on 1 thread; speed on t threads = t ** SCALING


def _engine_row(threads: int) -> dict:
    row = {}
    for b, (n, seqs, ctx, prefill) in {1: (40, 50, 900, 80), 8: (30, 300, 9000, 400), 32: (20, 800, 30000, 100),
                                       0: (5, 0, 0, 2000)}.items():
        seconds = (BASE * n + PER_SEQ * seqs + PER_CTX * ctx + PER_PREFILL * prefill) / threads ** SCALING
        for field, value in zip(("n", "s", "seqs", "ctx", "prefill"), (n, seconds, seqs, ctx, prefill)):
            row[f"engine/step_t{threads}_b{b}_{field}"] = value
    return row


def test_calibration_recovers_the_speeds_a_run_was_written_with(tmp_path):
    save_config(load_config(None, ["mode=async", "max_staleness=2", "trainer.batch_size=4", "rollout.group_size=2"]),
                tmp_path)
    rows = []
    for step in range(8):
        threads = 1 if step % 2 else 2
        tokens = 400 + 50 * step
        rows.append({"step": step, "time": 100.0 + 10 * step, "train/batch_tokens": tokens,
                     "timing/train_s": (OVERHEAD + PER_TOKEN * tokens) / threads ** SCALING,
                     "timing/train_threads": threads, "timing/publish_s": 0.2, "train/num_trajectories": 4,
                     "train/response_lens": [step + 1, 2, 3, 4], "train/prompt_len_mean": 6.0,
                     "train/staleness_hist": [1, 3, 0, 0]})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rollout = [{"time": 99.0, "rollout/generation_started": 1.0}, {"time": 150.0, "sync/update_s": 0.3},
               {"time": 180.0, "sync/update_s": 0.5, **_engine_row(1), **_engine_row(2)}]
    (tmp_path / "rollout_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollout))
    profile = calibrate(tmp_path)
    e, t = profile.engine, profile.trainer
    assert e.units == 1 and (e.step_base_s, e.per_seq_s, e.per_ctx_token_s, e.per_prefill_token_s) == pytest.approx(
        (BASE, PER_SEQ, PER_CTX, PER_PREFILL), rel=1e-6)
    assert e.scaling == pytest.approx(SCALING, rel=1e-6)
    assert (t.step_overhead_s, t.per_token_s, t.scaling) == pytest.approx((OVERHEAD, PER_TOKEN, SCALING), rel=1e-6)
    assert profile.sync.publish_s == pytest.approx(0.2) and profile.sync.load_s == pytest.approx(0.4)
    assert profile.response.samples == [n for r in rows for n in r["train/response_lens"]]
    assert profile.prompt_len == 6 and profile.config["max_staleness"] == 2
    assert profile.measured["staleness_hist"] == [8, 24, 0, 0]
    assert profile.measured["trained_traj_per_s"] == pytest.approx(32 / (170.0 - 99.0))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_controllers_cpu_per_request_between_updates_is_per_request_s(tmp_path, threads):
    """Between the first and the last logged update (not the evaluation and start-up before): the
    controller's CPU seconds per request, on one core whatever the engine's threads; a run that does not
    log them, or whose request count went back (a server restarted), leaves it 0."""
    save_config(load_config(None, ["mode=sync", "trainer.batch_size=4", "rollout.group_size=2"]), tmp_path)
    rows = [{"step": s, "time": 100.0 + s, "train/batch_tokens": 400, "timing/train_s": 0.5,
             "train/num_trajectories": 4, "train/response_lens": [2, 2, 2, 2]} for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = _engine_row(threads)
    first = {"rollout/cpu_s": 30.0, "engine/requests_total": 100.0}  # 100 requests of evaluation, start-up
    for last, expected in (({"rollout/cpu_s": 32.5, "engine/requests_total": 600.0}, 2.5 / 500),
                           ({}, 0.0), ({"rollout/cpu_s": 31.0, "engine/requests_total": 50.0}, 0.0)):
        rollout = [{"time": 99.0, "rollout/generation_started": 1.0}, {"time": 150.0, **engine, **first},
                   {"time": 180.0, **engine, **(last or first)}]
        (tmp_path / "rollout_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollout))
        profile = calibrate(tmp_path)
        assert profile.engine.units == threads
        assert profile.engine.per_request_s == pytest.approx(expected, rel=1e-9)
        assert profile.measured["per_request_measured"] == (expected > 0)


def test_an_async_run_beside_a_sync_one_measures_how_much_each_side_slows_the_other(tmp_path):
    """Speeds from the sync run; the async run, written with the engine 1.5x and the trainer 2x slower than
    those speeds while both worked the whole time (the engine's steps add up to more than the run), gives the
    overlap factors for its placement (shared)."""
    runs = []
    for mode, k_engine, k_trainer in (("sync", 1.0, 1.0), ("async", 1.5, 2.0)):
        d = tmp_path / mode
        save_config(load_config(None, [f"mode={mode}", "max_staleness=2", "trainer.batch_size=4",
                                       "rollout.group_size=2"]), d)
        rows, now = [], 0.0
        for step in range(8):
            tokens = 400 + 50 * step
            train_s = k_trainer * (OVERHEAD + PER_TOKEN * tokens)
            now += train_s  # the trainer never waits: busy the whole run
            rows.append({"step": step, "time": now, "train/batch_tokens": tokens, "timing/train_s": train_s,
                         "timing/train_threads": 1, "timing/publish_s": 0.0, "train/num_trajectories": 4,
                         "train/response_lens": [3 if mode == "sync" else 1] * 4, "train/prompt_len_mean": 6.0})
        more = 1 if mode == "sync" else 10  # 10x the engine steps: busy all along
        engine = {k: v * more * (k_engine if k.endswith("_s") else 1.0) for k, v in _engine_row(1).items()}
        rollout = [{"time": 0.0, "rollout/generation_started": 1.0}, {"time": now, **engine}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "rollout_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollout))
        runs.append(d)
    alone = calibrate(runs[0])
    both = calibrate(*runs)
    assert (alone.engine.overlap_shared, alone.trainer.overlap_shared) == (1.0, 1.0)
    assert both.engine.per_seq_s == pytest.approx(PER_SEQ, rel=1e-6)  # the speeds: from the sync run only
    assert both.trainer.per_token_s == pytest.approx(PER_TOKEN, rel=1e-6)
    assert both.engine.overlap_shared == pytest.approx(1.5, rel=1e-6)
    assert both.trainer.overlap_shared == pytest.approx(2.0, rel=1e-6)
    assert both.engine.overlap_pools == both.trainer.overlap_pools == 1.0
    assert set(both.response.samples) == {3}  # the lengths of the workload before asynchrony changed them
