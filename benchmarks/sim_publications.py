"""Published async-vs-sync results against `async-rl sim` with the GPU profiles of configs/sim/ (used by
benchmarks/sim_validation.py). Neither paper gives its response-length distribution, so its mean is
fitted to the published *sync* step time (one number); everything async is then predicted.

Published numbers (per step = per weight version, 512 prompts x 16 answers):
- AReaL (inclusionAI/AReaL blog/AReaL_v0_3.md; arXiv 2505.24298): 1.5B on 16 nodes of H800, 1000 PPO steps,
  synchronous 41.0 h, asynchronous 14.8 h (2.77x); "larger eta leads to higher throughput" (its Fig. 7, no
  numbers in the text).
- verl (volcengine/verl recipe/fully_async_policy/README.md): Qwen2.5-Math-7B on H20, colocate sync vs
  fully_async (staleness_threshold 0.5, partial rollout): per-step 790.10 / 294.77 s at 32 GPUs (16:16),
  365.28 / 189.26 s at 64 (32:32), 356.30 / 150.63 s at 128 (64:64); 400-step totals 2.66x, 1.92x, 2.35x.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from async_rl.sim import Placement, load_profile, sim_config
from async_rl.sim.run import scale_down, simulate_scaled
from async_rl.sim.sweep import mean_staleness

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12

AREAL_SYNC_S, AREAL_ASYNC_S = 41.0 * 3600 / 1000, 14.8 * 3600 / 1000
VERL = {32: (790.10, 294.77, 2.66, (16, 16)), 64: (365.28, 189.26, 1.92, (32, 32)), 128: (356.30, 150.63, 2.35, (64, 64))}
VERL_GEN = {32: 357.41, 64: 150.72, 128: 177.85}  # colocate sync: gen
VERL_ASYNC_UPDATE = {16: 313.81, 32: 156.98, 64: 113.16}  # fully_async: update_actor per version
VERL_TRAIN = {32: 107.71 + 269.80, 64: 70.26 + 133.41, 128: 53.92 + 113.81}  # old_log_prob + update_actor


def step_s(profile, mode: str, eta: int, placement: Placement) -> tuple[float, object]:
    cfg = sim_config(profile, [f"mode={mode}", f"max_staleness={eta}", f"total_steps={STEPS}"])
    result = simulate_scaled(profile, cfg, placement, scale_down(profile, cfg, [placement]))
    return cfg.trainer.batch_size / result.steady_traj_per_s, result


def with_mean(profile, mean: float):
    return dataclasses.replace(profile, response=dataclasses.replace(profile.response, mean=mean))


def fit_mean(profile, target_s: float, placement: Placement, phase: str = "step") -> tuple[object, float]:
    """The mean response length whose simulated sync `phase` (step, or gen) takes `target_s` (bisection in log space)."""
    lo, hi = math.log(200), math.log(40000)
    for _ in range(14):
        mid = (lo + hi) / 2
        if sync_phases(with_mean(profile, math.exp(mid)), placement)[phase] < target_s:
            lo = mid
        else:
            hi = mid
    mean = math.exp((lo + hi) / 2)
    return with_mean(profile, mean), mean


def sync_phases(profile, placement: Placement) -> dict[str, float]:
    """A sync step, and its generation part (the trainer's wait less the weight load) and train part."""
    step, result = step_s(profile, "sync", 0, placement)
    rows = result.records[result.warmup + 1:]
    wait = sum(r.wait_s for r in rows) / len(rows)
    train = step - wait - profile.sync.publish_total_s() - profile.sync.switch_s
    return {"step": step, "gen": wait - profile.sync.load_s, "train": train}


def fit_trainer(profile, target_train_s: float, placement: Placement):
    """The trainer's per-token time scaled so the simulated sync train phase takes `target_train_s`."""
    now = sync_phases(profile, placement)["train"]
    overhead = profile.trainer.step_overhead_s
    factor = (target_train_s - overhead) / (now - overhead)
    return dataclasses.replace(profile, trainer=dataclasses.replace(
        profile.trainer, per_token_s=profile.trainer.per_token_s * factor)), factor


def areal_section() -> tuple[str, list[dict]]:
    profile = load_profile(ROOT / "configs" / "sim" / "areal_h800_r1distill_1p5b.yaml")
    sync = Placement.shared(128)
    assumed_sync = sync_phases(profile, sync)["step"]
    fitted, mean = fit_mean(profile, AREAL_SYNC_S, sync)
    sync_s = sync_phases(fitted, sync)["step"]
    rows, lines = [], ["| split (rollout:trainer) | eta | predicted s/step | predicted vs sync | published | "
                       "mean staleness | dropped over eta |", "|" + "---|" * 7]
    for split in ((64, 64), (96, 32)):
        for eta in (0, 1, 2, 4, 8, 16):
            s, r = step_s(fitted, "async", eta, Placement.pools(*split))
            rows.append({"split": split, "eta": eta, "step_s": s, "gain": sync_s / s, "staleness": mean_staleness(r),
                         "dropped": r.staleness_hist[-1] / max(1, sum(r.staleness_hist))})
            published = f"{AREAL_ASYNC_S:.1f} s, {AREAL_SYNC_S / AREAL_ASYNC_S:.2f}x" if split == (64, 64) else ""
            lines.append(f"| {split[0]}:{split[1]} | {eta} | {s:.1f} | {sync_s / s:.2f}x | {published} | "
                         f"{mean_staleness(r):.2f} | {100 * rows[-1]['dropped']:.0f}% |")
    best = max(rows, key=lambda r: r["gain"])
    e8 = next(r for r in rows if r["split"] == (64, 64) and r["eta"] == 8)
    e0 = next(r for r in rows if r["split"] == (64, 64) and r["eta"] == 0)
    e1 = next(r for r in rows if r["split"] == (64, 64) and r["eta"] == 1)
    text = (f"## AReaL: 1.5B on 128 H800 (configs/sim/areal_h800_r1distill_1p5b.yaml)\n\n"
            f"Sync (colocated on 128 GPUs): published {AREAL_SYNC_S:.1f} s/step; the profile as committed (mean response "
            f"{profile.response.mean:,.0f} tokens) simulates {assumed_sync:.1f} s; fitted again to the published sync "
            f"time, the mean response is {mean:,.0f} tokens (simulated sync {sync_s:.1f} s/step; 10,000 tokens would "
            f"give {sync_phases(with_mean(profile, 10000), sync)['step']:.0f} s). Async predicted from there:\n\n"
            + "\n".join(lines) +
            f"\n\nAt AReaL's own split (64:64), eta=8 over eta=1: {e8['gain'] / e1['gain']:.2f}x, over eta=0: "
            f"{e8['gain'] / e0['gain']:.2f}x (AReaL: throughput rises with eta, Fig. 7, no numbers given; eta=0 on two "
            f"pools leaves each idle half the time); best predicted gain over sync {best['gain']:.2f}x at {best['split'][0]}:"
            f"{best['split'][1]}, eta={best['eta']}, against the published 2.77x.")
    return text, rows


def verl_section() -> tuple[str, list[dict]]:
    profile = load_profile(ROOT / "configs" / "sim" / "verl_h20_qwen2p5_math_7b.yaml")
    at64 = Placement.shared(64)
    fitted, mean = fit_mean(profile, VERL_GEN[64], at64, phase="gen")
    fitted, factor = fit_trainer(fitted, VERL_TRAIN[64], at64)
    # the fully-async recipe trains on the rollout's log-probs: no old-log-prob forward (6 of the 8 flops a token)
    async_profile = dataclasses.replace(fitted, trainer=dataclasses.replace(
        fitted.trainer, per_token_s=fitted.trainer.per_token_s * 6 / 8))
    # verl's async trainer is much cheaper per version than its sync one (156.98 s on 32 GPUs vs 133.41 + 70.26 s
    # on 64): shorter answers in those runs or better per-GPU efficiency. Fitted too, as a second prediction:
    measured_async = _trainer_only(async_profile, 32)
    verl_trainer = dataclasses.replace(async_profile, trainer=dataclasses.replace(
        async_profile.trainer, per_token_s=async_profile.trainer.per_token_s * VERL_ASYNC_UPDATE[32] / measured_async))
    rows, lines = [], ["| GPUs | sync s/step (gen + train): published | predicted | async split | async s/step: "
                       "published | predicted eta=0 | eta=1 | eta=1, verl's async trainer | gain: published | "
                       "predicted eta=0 | eta=1 | eta=1, verl's async trainer |", "|" + "---|" * 12]
    for gpus, (sync_pub, async_pub, gain_pub, split) in VERL.items():
        phases = sync_phases(fitted, Placement.shared(gpus))
        sync_s = phases["step"]
        a0, _ = step_s(async_profile, "async", 0, Placement.pools(*split))
        a1, _ = step_s(async_profile, "async", 1, Placement.pools(*split))
        v1, _ = step_s(verl_trainer, "async", 1, Placement.pools(*split))
        rows.append({"gpus": gpus, "sync_s": sync_s, "gen_s": phases["gen"], "train_s": phases["train"],
                     "async_eta0_s": a0, "async_eta1_s": a1, "async_eta1_verl_trainer_s": v1, "gain_eta0": sync_s / a0,
                     "gain_eta1": sync_s / a1, "gain_eta1_verl_trainer": sync_s / v1, "published_gain": gain_pub})
        lines.append(f"| {gpus} | {sync_pub:.0f} ({VERL_GEN[gpus]:.0f} + {VERL_TRAIN[gpus]:.0f}) | {sync_s:.0f} "
                     f"({phases['gen']:.0f} + {phases['train']:.0f}) | {split[0]}:{split[1]} | {async_pub:.0f} | "
                     f"{a0:.0f} | {a1:.0f} | {v1:.0f} | {gain_pub:.2f}x | {sync_s / a0:.2f}x | {sync_s / a1:.2f}x | "
                     f"{sync_s / v1:.2f}x |")
    text = (f"## verl fully_async: Qwen2.5-Math-7B on H20 (configs/sim/verl_h20_qwen2p5_math_7b.yaml)\n\n"
            f"Fitted to verl's published 64-GPU colocated sync step only: the mean response ({mean:,.0f} tokens) to its "
            f"generation phase ({VERL_GEN[64]} s) and the trainer's time per token (x{factor:.2f} of the profile's, "
            f"MFU {0.35 / factor:.2f}) to its old-log-prob + update phases ({VERL_TRAIN[64]:.2f} s). verl's "
            "staleness_threshold=0.5 lets 1.5 batches be in flight; this project's gate admits whole batches, so eta=0 "
            "and eta=1 bracket it. Async trains without the old-log-prob forward, as the recipe does.\n\n"
            + "\n".join(lines) + "\n\n" + _verl_summary(rows))
    return text, rows


def _verl_summary(rows: list[dict]) -> str:
    errs = [abs(r["async_eta1_verl_trainer_s"] - VERL[r["gpus"]][1]) / VERL[r["gpus"]][1] for r in rows]
    return (f"With the trainer speed of verl's own async runs (fitted at 32:32), the predicted async step is within "
            f"{100 * max(errs):.0f}% of the published one at every scale ({', '.join(f'{100 * e:.0f}%' for e in errs)}); "
            "the gains differ more because the sync baseline does: verl's colocated sync barely speeds up from 64 to 128 "
            "GPUs (365 -> 356 s: its generation got slower, 151 -> 178 s, with other answers in that run) while the "
            "model's scales with the GPUs. Without that fit (the sync runs' trainer speed) async comes out at "
            f"{min(r['gain_eta1'] for r in rows):.2f}-{max(r['gain_eta1'] for r in rows):.2f}x: verl's async trainer "
            "update takes 5,023 GPU-seconds per version at 32:32 against 8,538 for the sync update at 64 GPUs (1.7x "
            "fewer, beyond the 4,497 of old log-probs the recipe skips, which the model does account for): other answers "
            "or better per-GPU efficiency in those runs, which a model training the same answers at the same speed in "
            "both modes cannot produce.")


def _trainer_only(profile, gpus: int) -> float:
    """The trainer's time for one batch of mean-length answers on `gpus` GPUs (the profile's own model)."""
    tokens = profile.config["trainer.batch_size"] * (profile.prompt_len + profile.response.mean_length())
    return profile.trainer.step_s(tokens, gpus)
