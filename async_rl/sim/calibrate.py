"""`async-rl sim calibrate RUN_DIR [RUN_DIR...]`: a profile from a run's own metrics.

    profile = calibrate("runs/bench/pools_sync_0")                                # one run
    profile = calibrate("runs/bench/pools_sync_0", "runs/bench/shared_sync_0")   # pooled: 1 and 2 cores
    profile = calibrate(..., "runs/bench/pools_async_2", "runs/bench/shared_async_2")  # + overlap factors
    save_profile(profile, "configs/sim/cpu_bench.yaml")

- engine: the servers' step timings by (torch threads, batch) (`engine/step_t*` sums in
  rollout_metrics.jsonl) fitted, by non-negative least squares, to
  seconds = step_base_s + per_seq_s x seqs + per_ctx_token_s x context + per_prefill_token_s x prompt tokens
  at the thread count most steps ran with; steps on other thread counts give `scaling` (negative when more
  threads ran slower: oversubscribed cores, as on a machine busy with other work);
- trainer: `timing/train_s` against `train/batch_tokens` (and `timing/train_threads`, for `scaling`);
- requests: the controller's CPU seconds besides weight updates (`rollout/cpu_s`) per request the servers
  took, between the first and the last logged update (`per_request_s`: HTTP, streams, agents, rewards;
  CPU runs only);
- sync: the trainer's `timing/publish_s` and the rollout side's `sync/update_s` (median);
- lengths: every arrival's `train/response_lens` (empirical), `train/prompt_len_mean`;
- overlap: given sync runs and async ones, speeds come from the sync runs (the sides take turns) and
  each async run measures how much slower each side works while the other works too, on the same
  machine's cores (`engine/trainer.overlap_pools|overlap_shared`; shared caches, memory bandwidth,
  threads over the cores); lengths then come from the sync runs too;
- config: the run's batch size, group size, staleness bound, ... from its config.yaml;
- measured: what the run achieved (throughput, staleness), to check a prediction against.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from async_rl.config import config_from_yaml_text
from async_rl.sim.lengths import LengthDist
from async_rl.sim.profile import EngineProfile, Profile, SyncProfile, TrainerProfile, speed_on
from async_rl.utils.metrics import read_jsonl

_STEP_KEY = re.compile(r"^engine/step_t(\d+)_b(\d+)_(n|s|seqs|ctx|prefill)$")
CONFIG_KEYS = ("mode", "max_staleness", "total_steps", "trainer.batch_size", "rollout.group_size",
               "rollout.max_new_tokens", "rollout.max_concurrent", "rollout.restart_stale", "rollout.num_servers",
               "engine.max_running", "engine.max_tokens_per_step")


def calibrate(*run_dirs: str | Path) -> Profile:
    """A profile from one run, or from several (their engine steps, train steps and lengths pooled; the
    workload settings and `measured` are the first run's): e.g. a run pinned to one core and one on all
    cores show how speed grows with cores."""
    if not run_dirs:
        raise ValueError("sim calibrate: expected at least one RUN_DIR")
    runs = [_read(Path(d)) for d in run_dirs]
    run, cfg, rows, rollout_rows = runs[0]
    # speeds come from the runs where the two sides never work at once (sync); an async run among
    # several then measures only how much each side slows the other (the overlap factors)
    alone = [r for r in runs if r[1].mode == "sync"]
    together = [r for r in runs if r[1].mode != "sync"] if alone else []
    base = alone or runs
    sums: dict[tuple[int, int, str], float] = defaultdict(float)
    for _, _, _, more in base:
        for key, value in _last_profile(more).items():
            sums[key] += value
    engine, engine_fit = _engine(dict(sums), cfg)
    on_gpu = _on_gpu(cfg, rollout_rows)
    request_fit = {}
    if not on_gpu:
        engine.per_request_s, request_fit = _per_request([more for _, _, _, more in base])
    trainer, trainer_fit = _trainer([r for _, _, rs, _ in base for r in (rs[1:] if len(rs) > 2 else rs)])
    overlap_fit = _overlap(engine, trainer, together)
    updates = [r["sync/update_s"] for _, _, _, more in runs for r in more if "sync/update_s" in r]
    sync = SyncProfile(publish_s=_median([r.get("timing/publish_s", 0.0) for _, _, rs, _ in runs for r in rs]),
                       load_s=_median(updates), recompute=True)
    # the lengths of the runs the speeds come from: what the workload is before asynchrony changes it
    lengths = [int(n) for _, _, rs, _ in base for r in rs for n in r["train/response_lens"]]
    prompt = max(1, round(float(np.mean([r.get("train/prompt_len_mean", 1.0) for r in rows]))))
    config = {key: _get(cfg, key) for key in CONFIG_KEYS}
    return Profile(
        name=f"calibrated:{'+'.join(r[0].name for r in runs)}",
        units="gpu" if on_gpu else "core",
        sources=[f"async-rl sim calibrate {r}: {len(rs)} train steps, "
                 f"{int(sum(v for k, v in _last_profile(more).items() if k[2] == 'n'))} engine steps"
                 for r, _, rs, more in runs],
        engine=engine, trainer=trainer, sync=sync,
        response=LengthDist(kind="empirical", samples=lengths, max=cfg.rollout.max_new_tokens),
        prompt_len=prompt, config=config, measured={**_measured(run, rows, rollout_rows, cfg), **engine_fit,
                                                    **request_fit, **trainer_fit, **overlap_fit})


def _read(run: Path) -> tuple[Path, Any, list[dict], list[dict]]:
    if not (run / "config.yaml").is_file() or not (run / "metrics.jsonl").is_file():
        raise ValueError(f"{run}: not a run directory (needs config.yaml and metrics.jsonl)")
    cfg = config_from_yaml_text((run / "config.yaml").read_text())
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if not r.get("train/skipped_batch")]
    if len(rows) < 2 or "train/response_lens" not in rows[-1]:
        raise ValueError(f"{run}: too few train steps with the metrics a calibration needs "
                         "(train/response_lens, train/batch_tokens: a run of this version, at least 2 steps)")
    return run, cfg, rows, read_jsonl(run / "rollout_metrics.jsonl")


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else 0.0


def _last_profile(rollout_rows: list[dict]) -> dict[tuple[int, int, str], float]:
    """The engine step sums of the latest row that has them (they are running totals)."""
    for row in reversed(rollout_rows):
        found = {}
        for key, value in row.items():
            m = _STEP_KEY.match(key)
            if m:
                found[(int(m.group(1)), int(m.group(2)), m.group(3))] = float(value)
        if found:
            return found
    return {}


def _engine(sums: dict[tuple[int, int, str], float], cfg: Any) -> tuple[EngineProfile, dict]:
    if not sums:
        raise ValueError("rollout_metrics.jsonl: no engine/step_* timings (a run of an older version, "
                         "or a server that is not the embedded engine)")
    buckets: dict[int, list[list[float]]] = defaultdict(list)
    for t, b in sorted({(t, b) for t, b, _ in sums}):
        buckets[t].append([sums[(t, b, f)] for f in ("n", "s", "seqs", "ctx", "prefill")])
    ref = max(buckets, key=lambda t: sum(row[0] for row in buckets[t]))
    data = np.array(buckets[ref])
    coef = _nnls(data[:, [0, 2, 3, 4]], data[:, 1], weights=1 / np.sqrt(np.maximum(data[:, 0], 1)))
    scaling, seen = _scaling({t: np.array(rows) for t, rows in buckets.items()}, ref,
                             lambda d: d[:, [0, 2, 3, 4]] @ coef, lambda d: d[:, 1], lambda d: d[:, 0])
    base, per_seq, per_ctx, per_prefill = (float(c) for c in coef)
    profile = EngineProfile(step_base_s=base, per_seq_s=per_seq, per_ctx_token_s=per_ctx,
                            per_prefill_token_s=per_prefill, units=ref, scaling=scaling if seen else 1.0,
                            max_running=cfg.engine.max_running, max_tokens_per_step=cfg.engine.max_tokens_per_step)
    fit = data[:, [0, 2, 3, 4]] @ coef
    return profile, {"engine_fit_error": float(abs(fit.sum() - data[:, 1].sum()) / max(data[:, 1].sum(), 1e-9)),
                     "engine_threads_seen": {int(t): int(sum(r[0] for r in rows)) for t, rows in buckets.items()},
                     "engine_scaling_measured": seen}


def _on_gpu(cfg: Any, rollout_rows: list[dict]) -> bool:
    """The run's servers stepped on GPUs (configured so, or `device: auto` that found one)."""
    return cfg.engine.device.startswith("cuda") or any(r.get("engine/cuda_servers") for r in rollout_rows)


def _per_request(runs: list[list[dict]]) -> tuple[float, dict]:
    """The rollout controller's CPU seconds per request (`rollout/cpu_s`, which leaves out its weight
    updates, over the servers' `engine/requests_total`) between the first and the last update a run logs:
    after the evaluation before training and the start-up. Single-threaded Python: seconds of one core.
    0 when no run logs them (a run of an older version); a run whose counters went back (a server
    restarted) is left out. The servers' own HTTP work stays in their step and idle times."""
    spent = requests = 0.0
    for rollout_rows in runs:
        rows = [r for r in rollout_rows if "rollout/cpu_s" in r and "engine/requests_total" in r]
        if len(rows) < 2:
            continue
        took = rows[-1]["engine/requests_total"] - rows[0]["engine/requests_total"]
        cpu = rows[-1]["rollout/cpu_s"] - rows[0]["rollout/cpu_s"]
        if took > 0 and cpu >= 0:
            spent, requests = spent + cpu, requests + took
    if not requests:
        return 0.0, {"per_request_measured": False}
    return spent / requests, {"per_request_measured": True}


def _trainer(rows: list[dict]) -> tuple[TrainerProfile, dict]:
    threads = np.array([r.get("timing/train_threads", 1.0) for r in rows])
    tokens = np.array([r["train/batch_tokens"] for r in rows], dtype=float)
    secs = np.array([r["timing/train_s"] for r in rows], dtype=float)
    counts = np.bincount(np.rint(threads).astype(int))
    ref = int(np.argmax(counts))  # the thread count most steps ran with (the fewest on a tie)
    near = np.abs(threads - ref) < 0.25
    x, y = tokens[near], secs[near]
    if len(x) >= 4 and np.std(x) > 0.1 * np.mean(x):  # lengths vary enough to tell overhead from per-token cost
        overhead, per_token = (float(c) for c in _nnls(np.stack([np.ones_like(x), x], 1), y))
    else:
        overhead, per_token = 0.0, float(np.median(y / np.maximum(x, 1)))
    predict = overhead + per_token * tokens
    others = ~near & (np.abs(np.log(np.maximum(threads, 1e-9) / ref)) > 0.1)
    scaling, seen = 1.0, bool(others.sum() >= 2)
    if seen:  # speed on t threads relative to ref = predicted / measured; scaling = log(speed) / log(t / ref)
        logs = np.log(predict[others] / secs[others]) / np.log(threads[others] / ref)
        scaling = float(np.clip(np.median(logs), -3.0, 1.5))
    return (TrainerProfile(step_overhead_s=float(overhead), per_token_s=float(per_token), units=ref, scaling=scaling),
            {"trainer_threads_seen": sorted({round(float(t), 1) for t in threads}), "trainer_scaling_measured": seen})


def _overlap(engine: EngineProfile, trainer: TrainerProfile, runs: list) -> dict:
    """Set the profile's overlap factors from async runs (both sides at work at once), by placement: each
    side's measured time against what the alone-fitted profile predicts for the same work, the excess put on
    the share of the run during which the other side was busy. Returns what was measured."""
    found: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run, cfg, rows, rollout_rows in runs:
        wall = _wall(rows, rollout_rows) or 0.0
        steps = _last_profile(rollout_rows)
        if wall <= 0 or not steps:
            continue
        train_s = sum(r["timing/train_s"] for r in rows)
        engine_s = sum(v for k, v in steps.items() if k[2] == "s")
        predicted_engine = sum(engine.steps_s(*(steps[(t, b, f)] for f in ("n", "seqs", "ctx", "prefill")),
                                              speed=speed_on(t, engine.units, engine.scaling))
                               for t, b, f in steps if f == "n")
        predicted_train = sum(trainer.step_s(r["train/batch_tokens"], r.get("timing/train_threads", trainer.units))
                              for r in rows)
        # measured = predicted x (1 + (k - 1) x share of the time the other side was busy)
        for side, measured, predicted, other_busy in (("engine", engine_s, predicted_engine, train_s / wall),
                                                      ("trainer", train_s, predicted_train, engine_s / wall)):
            if predicted > 0 and other_busy > 0.05:
                found[side][_placement_kind(cfg)].append(1.0 + max(0.0, measured / predicted - 1.0) / min(1.0, other_busy))
    out = {}
    for side, profile in (("engine", engine), ("trainer", trainer)):
        for kind, factors in found[side].items():
            setattr(profile, f"overlap_{kind}", float(np.median(factors)))
            out[f"{side}_overlap_{kind}"] = float(np.median(factors))
    return out


def _scaling(data: dict[int, np.ndarray], ref: int, predict, actual, weight) -> tuple[float, bool]:
    """Speed on t threads vs ref from the steps run on t: (predicted at ref / measured) = (t / ref) ** scaling."""
    logs, weights = [], []
    for t, d in data.items():
        n = float(weight(d).sum())
        if t == ref or n < 20:
            continue
        logs.append(math.log(float(predict(d).sum()) / float(actual(d).sum())) / math.log(t / ref))
        weights.append(n)
    if not logs:
        return 1.0, False
    return float(np.clip(np.average(logs, weights=weights), -3.0, 1.5)), True


def _nnls(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Least squares with every coefficient >= 0 (features that would go negative are dropped and refit)."""
    w = np.ones(len(y)) if weights is None else weights
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def _wall(rows: list[dict], rollout_rows: list[dict]) -> float | None:
    """Seconds from the rollout side's first generation to the last train step (None: not logged)."""
    started = next((r["time"] for r in rollout_rows if "rollout/generation_started" in r), None)
    return rows[-1]["time"] - started if started is not None else None


def _placement_kind(cfg: Any) -> str:
    return "pools" if cfg.cores.engine or cfg.cores.trainer else "shared"


def _measured(run: Path, rows: list[dict], rollout_rows: list[dict], cfg: Any) -> dict[str, Any]:
    wall = _wall(rows, rollout_rows)
    hist: list[int] = []
    for r in rows:
        h = r.get("train/staleness_hist") or []
        hist = [a + b for a, b in zip(hist + [0] * (len(h) - len(hist)), h + [0] * (len(hist) - len(h)))]
    if _placement_kind(cfg) == "pools":
        placement = {"kind": "pools", "rollout": max(1, len(cfg.cores.engine)), "trainer": max(1, len(cfg.cores.trainer))}
    else:
        placement = {"kind": "shared", "total": max([t for t, _, _ in _last_profile(rollout_rows)] or [1])}
    return {"placement": placement, "wall_s": wall, "steps": len(rows),
            "trained_traj_per_s": sum(r["train/num_trajectories"] for r in rows) / wall if wall else None,
            "staleness_hist": hist}
