"""`async-rl report RUN_DIR` on a real finished debug run, on runs with more or fewer metrics, and on bad input."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib.patches import Rectangle
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from async_rl.report import RunDirError, compare_runs, load_run, plot_curves, write_report
from async_rl.report.panels import PANELS, draw_panel, engine_idle_share
from tests.e2e.clitools import FINISHED_STEPS, cli, cli_here

ALWAYS = ["reward", "accuracy", "throughput", "staleness", "queue", "interruptions", "idle", "optimisation",
          "learning"]


def assert_png(path: Path, min_px: int = 300) -> None:
    """A PNG that shows data: axes, text and grid are black and grey, so a plot with nothing drawn on its
    axes has (almost) no coloured pixel; every line, marker and bar the report draws is coloured."""
    with Image.open(path) as im:
        assert im.format == "PNG", path
        assert min(im.size) >= min_px, (path, im.size)
        rgb = np.asarray(im.convert("RGB"), dtype=np.int16)  # [H, W, 3]
    coloured = int(((rgb.max(axis=-1) - rgb.min(axis=-1)) > 60).sum())
    assert coloured >= 800, f"{path.name}: {coloured} coloured pixels: no data drawn"  # a legend alone has ~170


def plotted(fig) -> list[list[list[float]]]:
    """Per axes of a figure: the y values of every line, then the heights of its bars (as one list)."""
    out = []
    for ax in fig.axes:
        ys = [[float(y) for y in line.get_ydata()] for line in ax.lines]
        bars = [float(p.get_height()) for p in ax.patches if isinstance(p, Rectangle)]
        out.append(ys + ([bars] if bars else []))
    return out


def img_sources(index: Path) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', index.read_text())


@pytest.fixture
def debug_run(finished_run) -> Path:
    return finished_run  # tests/e2e/conftest.py: a finished debug run of FINISHED_STEPS steps


def test_report_of_a_finished_debug_run(debug_run):
    res = cli("report", str(debug_run))
    assert res.returncode == 0, res.stderr[-3000:]
    out = debug_run / "report"
    index = out / "index.html"
    sources = img_sources(index)
    assert f"report: {len(sources)} plots and {index}" in res.stdout
    for name in ALWAYS:
        assert f"{name}.png" in sources, name
    for src in sources:
        assert "/" not in src  # relative to the page: the report directory can be moved
        assert_png(out / src)
    assert sorted(p.name for p in out.glob("*.png")) == sorted(sources)
    html = index.read_text()
    assert "greedy accuracy" in html and "max_staleness" in html
    # panels whose metrics this run lacks are named on the page and on the console, not silently dropped
    for line in res.stdout.splitlines():
        if line.startswith("not drawn: "):
            assert line.split(": ", 2)[1] in html


def test_default_run_writes_tensorboard_events(debug_run):
    acc = EventAccumulator(str(debug_run / "tensorboard" / "metrics"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for key in ("train/reward_mean", "train/loss", "queue/depth", "timing/step_s", "policy_version"):
        assert key in scalars, key
    assert [e.step for e in acc.Scalars("train/reward_mean")] == list(range(FINISHED_STEPS))


def test_report_to_another_directory(debug_run, tmp_path):
    """In this process (`cli_here`): the real entry point is the test above; a child here paid ~4 s of imports."""
    res = cli_here("report", str(debug_run), "--out", str(tmp_path / "rep"))
    assert res.returncode == 0, res.stderr[-3000:]
    for src in img_sources(tmp_path / "rep" / "index.html"):
        assert_png(tmp_path / "rep" / src)


@pytest.mark.parametrize("make", ["missing", "empty_dir"])
def test_bad_run_dir_is_one_error_line(tmp_path, make):
    target = tmp_path / "run"
    if make == "empty_dir":
        target.mkdir()
    res = cli_here("report", str(target))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: RUN_DIR: "), res.stderr
    assert not (target / "report").exists()


@pytest.mark.parametrize("make,message", [("empty_files", "has no metrics yet"), ("a_file", "is not a directory"),
                                          ("broken_line", "line 1 is not JSON")])
def test_what_is_not_a_run_dir_is_named(tmp_path, make, message):
    target = tmp_path / "run"
    if make == "a_file":
        target.write_text("x")
    else:
        target.mkdir()
        for name in ("metrics.jsonl", "rollout_metrics.jsonl", "eval.jsonl"):
            (target / name).write_text("")
        if make == "broken_line":
            (target / "eval.jsonl").write_text('{oops\n{"when": "after"}\n')
    with pytest.raises(RunDirError, match=message):
        write_report(target)


def _rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def synthetic_run(run_dir: Path, steps: int = 12, eta: int = 2, extra: bool = True) -> Path:
    """A run directory with every metric the report knows, as the lead's newer processes log them."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"mode: async\nmax_staleness: {eta}\ntotal_steps: {steps}\n")
    train = []
    for s in range(steps):
        row = {"step": s, "time": 1000.0 + s, "policy_version": s + 1, "train/reward_mean": s / steps,
               "train/num_trajectories": 16.0, "timing/step_s": 1.0, "timing/wait_s": 0.4, "timing/train_s": 0.5,
               "timing/publish_s": 0.1, "train/staleness_mean": 0.5, "train/staleness_max": 1.0,
               "queue/depth": s % 3, "rollout/interrupted": s % 2, "train/loss": 0.1, "train/grad_norm": 1.0}
        if extra:
            row |= {"train/staleness_hist": [8, 6, 2][: eta + 1], "train/versions_per_traj_mean": 1.2,
                    "timing/idle_s": 0.3, "train/entropy": 1.0 - s / steps, "train/kl_init": 0.01 * s,
                    "train/grad_norm_clipped": 0.5, "train/zero_var_groups_frac": 0.25,
                    "train/response_len_mean": 10.0 + s}
        train.append(row)
    _rows(run_dir / "metrics.jsonl", train)
    _rows(run_dir / "rollout_metrics.jsonl", [
        {"step": v, "time": 1000.5 + v, "rollout/in_flight": 5, "engine/tokens_per_s": 100.0 + v,
         "sync/update_s": 0.1, **({"engine/idle_frac": 0.2} if extra else {})} for v in range(1, steps + 1)])
    evals = [{"when": "before", "policy_version": 0, "eval/accuracy": 0.1, "eval/n": 8}]
    if extra:
        evals.append({"when": "during", "step": 5, "policy_version": 6, "timing/train_wall_s": 6.0,
                      "eval/accuracy": 0.4, "eval/n": 8})
    evals.append({"when": "after", "policy_version": steps, "eval/accuracy": 0.6, "eval/n": 8})
    _rows(run_dir / "eval.jsonl", evals)
    return run_dir


def test_every_panel_is_drawn_when_every_metric_is_there(tmp_path):
    report = write_report(synthetic_run(tmp_path / "full"))
    assert report.skipped == []
    assert [p.stem for p in report.images] == ALWAYS[:4] + ["staleness_hist", "versions"] + ALWAYS[4:]
    for p in report.images:
        assert_png(p)
    assert "not drawn" not in report.index.read_text()


def test_panels_plot_the_runs_own_numbers(tmp_path):
    """What each main panel draws is the run's metrics, not merely some figure."""
    run = load_run(synthetic_run(tmp_path / "full", steps=12, eta=2))
    rewards = [s / 12 for s in range(12)]
    reward_steps, reward_wall = plotted(draw_panel(run, PANELS["reward"]).figure)
    assert rewards in reward_steps and rewards in reward_wall  # the raw points, under their trailing mean
    assert plotted(draw_panel(run, PANELS["accuracy"]).figure)[0] == [[0.1, 0.4, 0.6]]
    _, hist = plotted(draw_panel(run, PANELS["staleness"]).figure)
    assert hist == [[12 * 8.0, 12 * 6.0, 12 * 2.0]]  # the whole-run histogram: every step's [8, 6, 2] summed
    interrupted, update = plotted(draw_panel(run, PANELS["interruptions"]).figure)
    assert interrupted == [[float(s % 2) for s in range(12)]] and update == [[0.1] * 12]
    loss, grad = plotted(draw_panel(run, PANELS["optimisation"]).figure)
    assert loss == [[0.1] * 12] and grad == [[1.0] * 12]
    drift, clipping, batches, length = plotted(draw_panel(run, PANELS["learning"]).figure)
    assert drift == [[1.0 - s / 12 for s in range(12)], [0.01 * s for s in range(12)]]
    assert clipping == [[1.0] * 12, [0.5] * 12] and batches == [[0.25] * 12, rewards]
    assert length == [[10.0 + s for s in range(12)]]


def test_missing_metrics_skip_their_panel_and_say_so(tmp_path):
    run = synthetic_run(tmp_path / "old", extra=False)
    write_report(run)  # a stale plot from an earlier report must not survive a panel that is now skipped
    (run / "report" / "versions.png").write_bytes(b"old")
    report = write_report(run)
    names = [p.stem for p in report.images]
    assert "staleness_hist" not in names and "versions" not in names
    assert not (run / "report" / "versions.png").exists()
    html = report.index.read_text()
    assert ("Engine idle time: not drawn, the run has no engine/idle_frac (rollout_metrics.jsonl) or "
            "engine/idle_s_total (rollout_metrics.jsonl)") in html
    assert any("train/staleness_hist" in s for s in report.skipped)


def test_rollout_side_alone_and_a_half_written_last_line(tmp_path):
    run = synthetic_run(tmp_path / "r")
    (run / "metrics.jsonl").unlink()
    with (run / "rollout_metrics.jsonl").open("a") as fh:
        fh.write('{"step": 99, "engine/tok')  # the run is still writing
    report = write_report(run)
    assert {p.stem for p in report.images} == {"accuracy", "throughput", "queue", "interruptions", "idle"}
    assert any(s.startswith("Train reward: the run has no train/reward_mean") for s in report.skipped)


def test_benchmark_helpers_draw_several_runs(tmp_path):
    a = synthetic_run(tmp_path / "a")
    b = synthetic_run(tmp_path / "b", eta=1, extra=False)
    assert_png(compare_runs({"async η=2": a, "async η=1": b}, tmp_path / "curves.png"))
    path = plot_curves({"x": ([0, 1, 2], [0.0, 0.5, 1.0]), "y": ([0, 1, 2], [1.0, 0.5, 0.0])}, tmp_path / "c.png",
                       title="t", xlabel="step", ylabel="reward")
    assert_png(path, min_px=200)
    with pytest.raises(ValueError, match="path"):
        plot_curves({}, title="t", xlabel="x", ylabel="y")


def testengine_idle_share_from_cumulative_idle_seconds(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    _rows(run_dir / "rollout_metrics.jsonl", [{"step": v, "time": 100.0 + 2 * v, "engine/idle_s_total": 0.5 * v}
                                              for v in range(1, 6)])
    xs, ys = engine_idle_share(load_run(run_dir))
    assert xs == [2, 3, 4, 5] and ys == pytest.approx([25.0] * 4)  # 0.5 s idle in every 2 s
    report = write_report(run_dir)
    assert "idle" in [p.stem for p in report.images]
