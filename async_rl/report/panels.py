"""The report's panels: one figure each, made of charts that draw whatever keys a run logged.

`PANELS` maps a panel name (also its PNG's name) to a `Panel`: a title, a sentence for the
page and its charts. A chart names the metrics it needs; when a run lacks them the chart is
left out and the page says which keys were missing, so older runs and runs from a side
alone (trainer or rollout) still get a report of what they have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from async_rl.report.data import XLABELS, RunData
from async_rl.report.plots import default_window, new_figure, plot_curves, stacked_bars

VERSION_X = "policy version (train steps done)"


@dataclass(frozen=True)
class Chart:
    title: str
    needs: Callable[[RunData], list[str]]  # the missing metrics, `key (file)`; [] when it can be drawn
    draw: Callable[[RunData, Axes], None]


@dataclass(frozen=True)
class Panel:
    title: str
    about: str
    charts: tuple[Chart, ...]


@dataclass
class Drawn:
    figure: Figure | None  # None when no chart of the panel could be drawn
    lacking: dict[str, list[str]]  # chart left out -> the metrics it lacked

    @property
    def notes(self) -> list[str]:
        return [f"{chart}: not drawn, the run has no {', '.join(keys)}" for chart, keys in self.lacking.items()]


def needs(source: str, *keys: str) -> Callable[[RunData], list[str]]:
    return lambda run: run.missing(source, *keys)


def needs_any(source: str, *keys: str) -> Callable[[RunData], list[str]]:
    def check(run: RunData) -> list[str]:
        return [] if any(run.has(source, k) for k in keys) else [" or ".join(run.missing(source, *keys))]
    return check


def draw_panel(run: RunData, panel: Panel) -> Drawn:
    lacking = {chart.title: chart.needs(run) for chart in panel.charts}
    ready = [chart for chart in panel.charts if not lacking[chart.title]]
    lacking = {title: keys for title, keys in lacking.items() if keys}
    if not ready:
        return Drawn(None, lacking)
    fig, axes = new_figure(len(ready), title=panel.title)
    for chart, ax in zip(ready, axes):
        chart.draw(run, ax)
    return Drawn(fig, lacking)


def _curve(source: str, key: str, label: str, title: str, ylabel: str, x: str = "step", *, smoothed: bool = False,
           markers: bool = False, ylim: tuple[float, float] | None = None, counts: bool = False) -> Chart:
    def draw(run: RunData, ax: Axes) -> None:
        xs, ys = run.series(source, key, x)
        xlabel = VERSION_X if source != "train" and x == "step" else XLABELS[x]
        plot_curves({label: (xs, ys)}, ax=ax, title=title, xlabel=xlabel, ylabel=ylabel, markers=markers,
                    smooth_window=default_window(len(ys)) if smoothed else 1, ylim=ylim)
        if counts:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return Chart(title, needs(source, key), draw)


def _staleness_lines(run: RunData, ax: Axes) -> None:
    curves = {label: run.series("train", key) for key, label in
              [("train/staleness_mean", "mean over the batch"), ("train/staleness_max", "max in the batch")]
              if run.has("train", key)}
    eta = run.config.get("max_staleness")
    plot_curves(curves, ax=ax, title="Staleness of trained trajectories", xlabel=XLABELS["step"],
                ylabel="versions behind the trainer", markers=True, legend=True,
                hlines={f"bound max_staleness={eta}": eta} if isinstance(eta, int) else None)
    ax.set_ylim(bottom=0)


def _hists(run: RunData) -> tuple[list[float], list[list[float]]]:
    steps, hists = [], []
    for row in run.train:
        hist = row.get("train/staleness_hist")
        if isinstance(hist, list) and row.get("step") is not None:
            steps.append(row["step"])
            hists.append([float(c) for c in hist])
    return steps, hists


def _staleness_per_step(run: RunData, ax: Axes) -> None:
    steps, hists = _hists(run)
    lags = max(len(h) for h in hists)
    layers = {f"lag {lag}": [h[lag] if lag < len(h) else 0.0 for h in hists] for lag in range(lags)}
    stacked_bars(ax, steps, layers, title="Per step: trained trajectories by lag", xlabel=XLABELS["step"],
                 ylabel="trajectories", colors=[f"C{lag % 10}" for lag in range(lags)])


def _staleness_total(run: RunData, ax: Axes) -> None:
    _, hists = _hists(run)
    lags = max(len(h) for h in hists)
    totals = [sum(h[lag] for h in hists if lag < len(h)) for lag in range(lags)]
    ax.bar(range(lags), totals, color=[f"C{lag % 10}" for lag in range(lags)], width=0.7)
    ax.set_xticks(range(lags))
    ax.set_title("Whole run: trained trajectories by lag")
    ax.set_xlabel("lag (trainer version - oldest token version)")
    ax.set_ylabel("trajectories")


def _versions(run: RunData, ax: Axes) -> None:
    curves = {label: run.series("train", key) for key, label in
              [("train/versions_per_traj_mean", "mean over the batch"), ("train/versions_per_traj_max", "max")]
              if run.has("train", key)}
    plot_curves(curves, ax=ax, title="Versions mixed per trajectory", xlabel=XLABELS["step"],
                ylabel="distinct policy versions", markers=True, legend=True)
    ax.set_ylim(bottom=0)


def _throughput(run: RunData, ax: Axes) -> None:
    rows = [r for r in run.train if r.get("train/num_trajectories") is not None and r.get("timing/step_s")]
    window = max(2, default_window(len(rows)))
    xs, rolling, cumulative = [], [], []
    done = spent = 0.0
    for i, row in enumerate(rows):
        done += row["train/num_trajectories"]
        spent += row["timing/step_s"]
        recent = rows[max(0, i - window + 1): i + 1]
        xs.append(row["step"])
        rolling.append(sum(r["train/num_trajectories"] for r in recent) / sum(r["timing/step_s"] for r in recent))
        cumulative.append(done / spent)
    plot_curves({f"over the last {window} steps": (xs, rolling), "since the start": (xs, cumulative)}, ax=ax,
                title="Trainer: trajectories trained per second", xlabel=XLABELS["step"], ylabel="trajectories / s")


def _interrupted(run: RunData, ax: Axes) -> None:
    xs, ys = run.series("train", "rollout/interrupted")
    ax.bar(xs, ys, color="C3", width=0.85)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"Interrupted trajectories per batch (total {sum(ys):.0f})")
    ax.set_xlabel(XLABELS["step"])
    ax.set_ylabel("trajectories resumed after a weight update")


IDLE_KEYS = ("timing/idle_s", "timing/wait_s")  # the lead's idle time, or the older wait-for-a-batch time


def _trainer_time(run: RunData, ax: Axes) -> None:
    idle = next(k for k in IDLE_KEYS if run.has("train", k))
    parts = [(idle, "idle (waiting for trajectories)"), ("timing/train_s", "training"),
             ("timing/publish_s", "publishing weights")]
    rows = [r for r in run.train if r.get("step") is not None]
    layers = {label: [r.get(key) or 0.0 for r in rows] for key, label in parts if run.has("train", key)}
    stacked_bars(ax, [r["step"] for r in rows], layers, title="Trainer: where each step's time went",
                 xlabel=XLABELS["step"], ylabel="seconds", colors=["0.7", "C0", "C2"][:len(layers)])


ENGINE_IDLE_KEYS = ("engine/idle_frac", "engine/idle_s_total")  # a share per update, or cumulative seconds


def engine_idle_share(run: RunData) -> tuple[list[float], list[float]]:
    """% idle per weight update: logged directly, or the growth of the idle seconds over the elapsed time."""
    if run.has("rollout", "engine/idle_frac"):
        xs, ys = run.series("rollout", "engine/idle_frac")
        return xs, [100.0 * y for y in ys]
    rows = [r for r in run.rollout if r.get("engine/idle_s_total") is not None and "time" in r and "step" in r]
    xs, ys = [], []
    for prev, row in zip(rows, rows[1:]):
        elapsed = row["time"] - prev["time"]
        if elapsed > 0:
            xs.append(row["step"])
            ys.append(100.0 * (row["engine/idle_s_total"] - prev["engine/idle_s_total"]) / elapsed)
    return xs, ys


def _engine_idle(run: RunData, ax: Axes) -> None:
    xs, ys = engine_idle_share(run)
    plot_curves({"engine": (xs, ys)}, ax=ax, title="Generation engine idle time", xlabel=VERSION_X,
                ylabel="% of time idle", markers=True, ylim=(0, max([100.0, *ys])))


def _lines(title: str, ylabel: str, keys: list[tuple[str, str]], *, log: bool = False) -> Chart:
    """One chart of several train/ metrics (the ones the run logged), each a line over train steps."""
    def draw(run: RunData, ax: Axes) -> None:
        curves = {label: run.series("train", key) for key, label in keys if run.has("train", key)}
        plot_curves(curves, ax=ax, title=title, xlabel=XLABELS["step"], ylabel=ylabel, markers=True, legend=True)
        if log and all(y > 0 for _, ys in curves.values() for y in ys):
            ax.set_yscale("log")
    return Chart(title, needs_any("train", *[key for key, _ in keys]), draw)


LEARNING = (
    _lines("Policy entropy and drift", "nats per token", [
        ("train/entropy", "entropy of the trained tokens"), ("train/kl_init", "KL(start || now), probe"),
        ("train/kl_prev", "KL(v-1 || v), last update"), ("train/logprob_mismatch_kl", "engine/trainer mismatch")]),
    _lines("Gradient and clipping", "L2 norm / share", [
        ("train/grad_norm", "grad norm before clipping"), ("train/grad_norm_clipped", "after clipping"),
        ("train/clip_frac", "PPO clip fraction"), ("train/behav_capped_frac", "behaviour weight over the cap")]),
    _lines("Batches", "share", [
        ("train/zero_var_groups_frac", "groups without reward variance"), ("train/truncated_frac", "cut answers"),
        ("train/reward_mean", "reward")]),
    _curve("train", "train/response_len_mean", "mean", "Response length", "tokens", markers=True),
)


PANELS: dict[str, Panel] = {
    "reward": Panel("Train reward", "Mean reward of each trained batch (faint) and its trailing mean.", (
        _curve("train", "train/reward_mean", "reward", "Over train steps", "mean reward", smoothed=True),
        _curve("train", "train/reward_mean", "reward", "Over wall time", "mean reward", "wall", smoothed=True))),
    "accuracy": Panel("Greedy accuracy on held-out problems", "Evaluation rows of eval.jsonl (before, during "
                      "and after training).", (
        _curve("eval", "eval/accuracy", "accuracy", "Over policy versions", "fraction correct", markers=True,
               ylim=(-0.02, 1.02)),
        _curve("eval", "eval/accuracy", "accuracy", "Over wall time", "fraction correct", "wall", markers=True,
               ylim=(-0.02, 1.02)))),
    "throughput": Panel("Throughput", "Trajectories the trainer consumed per second of its loop, and the "
                        "engine's generation rate at each weight update.", (
        Chart("Trainer throughput", needs("train", "train/num_trajectories", "timing/step_s"), _throughput),
        _curve("rollout", "engine/tokens_per_s", "engine", "Engine: generated tokens per second",
               "tokens / s", markers=True))),
    "staleness": Panel("Staleness", "How many versions behind the trainer the trained trajectories were "
                       "(lag = trainer version - oldest token version); the bound is max_staleness.", (
        Chart("Staleness over steps", needs_any("train", "train/staleness_mean", "train/staleness_max"),
              _staleness_lines),
        Chart("Whole-run staleness histogram", needs("train", "train/staleness_hist"), _staleness_total))),
    "staleness_hist": Panel("Per-step staleness histogram", "Each train batch split by lag.", (
        Chart("Per-step staleness histogram", needs("train", "train/staleness_hist"), _staleness_per_step),)),
    "versions": Panel("Policy versions per trajectory", "Weight updates interrupt generation, so one "
                      "response can mix tokens sampled by several policy versions.", (
        Chart("Versions mixed per trajectory",
              needs_any("train", "train/versions_per_traj_mean", "train/versions_per_traj_max"), _versions),)),
    "queue": Panel("Trajectory queue", "Trajectories waiting in the queue after each train step, and "
                   "generations in flight on the rollout side at each weight update.", (
        _curve("train", "queue/depth", "queued", "Queue depth (trainer side)", "trajectories", markers=True,
               counts=True),
        _curve("rollout", "rollout/in_flight", "in flight", "In flight (rollout side)", "trajectories",
               markers=True, counts=True))),
    "interruptions": Panel("Interruptions", "Trajectories whose generation a weight update paused (KV "
                           "recomputed, then continued), and how long each update paused the engine.", (
        Chart("Interrupted trajectories", needs("train", "rollout/interrupted"), _interrupted),
        _curve("rollout", "sync/update_s", "update", "Weight update pause", "seconds", markers=True))),
    "idle": Panel("Idle time", "Trainer: time per step split into waiting for data, training and "
                  "publishing. Engine: share of time with nothing to generate.", (
        Chart("Trainer time per step", needs_any("train", *IDLE_KEYS), _trainer_time),
        Chart("Engine idle time", needs_any("rollout", *ENGINE_IDLE_KEYS), _engine_idle))),
    "optimisation": Panel("Optimisation", "Decoupled-PPO loss and gradient norm per train step.", (
        _curve("train", "train/loss", "loss", "Loss", "decoupled-PPO loss"),
        _curve("train", "train/grad_norm", "grad norm", "Gradient norm (before clipping)", "L2 norm"))),
    "learning": Panel("Learning diagnostics", "What moves before a run falls back: the policy's entropy, its KL "
                      "to the starting weights (a probe of the first step's responses) and to the version before, "
                      "the gradient before and after clipping, and the batches' groups without signal.", LEARNING),
}
