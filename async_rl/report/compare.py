"""Several runs on the same axes: the learning curves the benchmarks draw (reward and accuracy over
train steps and over wall time), one line per run.

    compare_runs({"sync": "runs/bench_sync_0", "async η=1": "runs/bench_async_1"}, "results/curves.png")
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from async_rl.report.data import XLABELS, RunData, load_run
from async_rl.report.plots import default_window, new_figure, plot_curves, save

CHARTS = [  # (source, key, x, title, ylabel)
    ("train", "train/reward_mean", "step", "Train reward over train steps", "mean reward"),
    ("train", "train/reward_mean", "wall", "Train reward over wall time", "mean reward"),
    ("eval", "eval/accuracy", "wall", "Greedy accuracy over wall time", "fraction correct"),
]


def compare_runs(runs: Mapping[str, str | Path | RunData], path: str | Path, *,
                 title: str = "Learning curves") -> Path:
    """One figure, a chart per entry of CHARTS that some run has data for, each run a labelled line."""
    loaded = {label: run if isinstance(run, RunData) else load_run(run) for label, run in runs.items()}
    charts = [c for c in CHARTS if any(run.has(c[0], c[1]) for run in loaded.values())]
    if not charts:
        raise ValueError(f"compare_runs: none of the runs has {', '.join(sorted({c[1] for c in CHARTS}))}")
    fig, axes = new_figure(len(charts), title=title, width=5.6)
    for (source, key, x, chart_title, ylabel), ax in zip(charts, axes):
        curves = {label: run.series(source, key, x) for label, run in loaded.items() if run.has(source, key)}
        window = default_window(max(len(ys) for _, ys in curves.values())) if source == "train" else 1
        plot_curves(curves, ax=ax, title=chart_title, xlabel=XLABELS[x], ylabel=ylabel,
                    smooth_window=window, markers=source == "eval")
    return save(fig, path)
