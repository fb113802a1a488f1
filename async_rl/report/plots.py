"""Plot helpers on matplotlib's Agg canvas (no display, no pyplot global state), shared by the
run report and the benchmarks.

    from async_rl.report.plots import plot_curves
    plot_curves({"sync": (steps, rewards), "async η=1": (steps2, rewards2)}, "reward.png",
                title="Train reward", xlabel="train step", ylabel="mean reward", smooth_window=5)

`plot_curves` draws several named curves on one axes (a new figure saved to `path`, or an
axes you pass); `new_figure`, `stacked_bars` and `no_data` build the report's panels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

Curve = tuple[Sequence[float], Sequence[float]]  # (xs, ys)
DPI = 110


def new_figure(ncols: int = 1, *, title: str | None = None, width: float = 6.2,
               height: float = 4.0) -> tuple[Figure, list[Axes]]:
    """A figure with `ncols` axes side by side (each `width` x `height` inches)."""
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0].tolist()
    if title:
        fig.suptitle(title, fontsize=13, fontweight="bold")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, axes


def save(fig: Figure, path: str | Path) -> Path:
    """Writes the figure as PNG and returns its path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI, format="png")
    return out


def smooth(ys: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` points (fewer at the start)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def default_window(n: int) -> int:
    """A smoothing window that shows the trend of `n` noisy points: about a tenth of them."""
    return max(1, n // 10)


def plot_curves(curves: Mapping[str, Curve], path: str | Path | None = None, *, title: str, xlabel: str,
                ylabel: str, ax: Axes | None = None, smooth_window: int = 1, markers: bool = False,
                hlines: Mapping[str, float] | None = None, ylim: tuple[float, float] | None = None,
                legend: bool | None = None) -> Path | None:
    """Draws each named (xs, ys) curve; with `smooth_window` > 1 the raw points are faint under a trailing mean.

    With `ax` it draws there and returns None; otherwise it makes a figure, saves it to `path`
    and returns the path. `hlines` are labelled dashed reference lines (e.g. a bound). The legend
    shows when there is more than one line, unless `legend` says otherwise.
    """
    if ax is None and path is None:
        raise ValueError("plot_curves: give `path` (a new figure is saved there) or `ax` (draw on it)")
    fig = None
    if ax is None:
        fig, (ax,) = new_figure(title=None)
    for i, (label, (xs, ys)) in enumerate(curves.items()):
        color = f"C{i % 10}"
        style = {"marker": "o", "markersize": 4} if markers else {}
        if smooth_window > 1 and len(ys) > smooth_window:
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
            ax.plot(xs, smooth(ys, smooth_window), color=color, linewidth=2,
                    label=f"{label} (mean of last {smooth_window})")
        else:
            ax.plot(xs, ys, color=color, linewidth=2, label=label, **style)
    for j, (label, y) in enumerate((hlines or {}).items()):
        ax.axhline(y, color="0.3", linestyle="--", linewidth=1, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    if legend or (legend is None and len(ax.get_legend_handles_labels()[0]) > 1):  # else the title names it
        ax.legend(fontsize=8)
    return save(fig, path) if fig is not None else None


def stacked_bars(ax: Axes, xs: Sequence[float], layers: Mapping[str, Sequence[float]], *, title: str,
                 xlabel: str, ylabel: str, colors: Sequence[str] | None = None) -> None:
    """One bar per x, split into the named layers (bottom first)."""
    bottom = [0.0] * len(xs)
    for i, (label, ys) in enumerate(layers.items()):
        color = colors[i] if colors else f"C{i % 10}"
        ax.bar(xs, ys, bottom=bottom, label=label, color=color, width=0.85)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=min(len(layers), 4),
              frameon=False)  # below the axes: bars fill them


def no_data(ax: Axes, title: str, text: str) -> None:
    """An empty axes that says which metrics it would have drawn."""
    ax.set_title(title)
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=9, color="0.35",
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
