"""MetricsLogger writes TensorBoard events a real TensorBoard reads back: scalars, bin-count and sample histograms."""

import json

import pytest

from async_rl.utils.metrics import MetricsLogger, read_jsonl

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def _events(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_every_numeric_key_becomes_a_scalar_and_lists_histograms(tmp_path):
    m = MetricsLogger(tmp_path / "metrics.jsonl", tensorboard=True)
    assert m.tensorboard_dir == tmp_path / "tensorboard" / "metrics"
    for step in range(3):
        m.log({"train/reward_mean": 0.25 * step, "queue/depth": 4 + step, "train/loss": float("nan"),
               "rollout/paused": True, "eval/when": "after",
               "train/staleness_hist": [5, 2 * step, 0, 1],  # counts per lag 0..3
               "train/response_lens": [3.0, 4.0, 4.0, 9.0]}, step)
    m.close()

    acc = _events(tmp_path / "tensorboard" / "metrics")
    tags = acc.Tags()
    assert set(tags["scalars"]) == {"train/reward_mean", "queue/depth"}  # NaN, bool and str are not scalars
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert [e.value for e in acc.Scalars("queue/depth")] == [4, 5, 6]
    assert set(tags["histograms"]) == {"train/staleness_hist", "train/response_lens"}

    hist = acc.Histograms("train/staleness_hist")
    assert [h.step for h in hist] == [0, 1, 2]
    last = hist[-1].histogram_value
    assert list(last.bucket) == [5, 4, 0, 1]  # one bucket per lag, counts kept as given
    assert list(last.bucket_limit) == [0.5, 1.5, 2.5, 3.5]
    assert (last.min, last.max, last.num) == (0, 3, 10)
    assert last.sum == pytest.approx(0 * 5 + 1 * 4 + 3 * 1)

    samples = acc.Histograms("train/response_lens")[0].histogram_value
    assert samples.num == 4 and samples.sum == pytest.approx(20.0)
    assert (samples.min, samples.max) == (3.0, 9.0)

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["train/loss"] is None and rows[2]["train/staleness_hist"] == [5, 4, 0, 1]


def test_empty_or_all_zero_hist_is_skipped_and_jsonl_alone_without_tensorboard(tmp_path):
    m = MetricsLogger(tmp_path / "a.jsonl", tensorboard=True)
    m.log({"train/staleness_hist": [0, 0], "x/empty": [], "x/nested": [[1]], "x/v": 1}, 0)
    m.close()
    tags = _events(tmp_path / "tensorboard" / "a").Tags()
    assert tags["histograms"] == [] and tags["scalars"] == ["x/v"]

    plain = MetricsLogger(tmp_path / "b.jsonl", tensorboard=False)
    plain.log({"x/v": 2}, 0)
    plain.close()
    assert plain.tensorboard_dir is None and not (tmp_path / "tensorboard" / "b").exists()


def test_read_jsonl_skips_a_half_written_last_line_but_not_a_broken_middle_one(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"step": 0}) + "\n" + json.dumps({"step": 1}) + "\n" + '{"step": 2, "tra')
    assert [r["step"] for r in read_jsonl(p)] == [0, 1]
    p.write_text('{"step": 0}\n{oops\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"line 2 is not JSON"):
        read_jsonl(p)
    assert read_jsonl(tmp_path / "missing.jsonl") == []
