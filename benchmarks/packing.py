"""Trained tokens per second of the `single` trainer with packed and with padded micro-batches, on a
long-tailed mix of lengths, and what share of this machine's GEMM speed that is.

Every step trains the same fixed batches (8 prompts x 8 answers, prompts of 16-32 tokens,
responses long-tailed: lognormal, median `--median` tokens, sigma 1, cut to 4..`--longest`; a
tenth of response tokens masked out as tool output) on a Llama-shaped model built from the seed
(`--hidden`, `--layers`; 8 heads, 4 KV heads, vocabulary 100), fp32, one minibatch, the
default micro-batch budget (4096 tokens, 256 overhead). `trainer.pack_sequences=false` pads each
micro-batch to its longest row (cut where that saves padding); `true` puts it in one row of
its tokens. A run is a fresh trainer, one warm-up step, `--steps` timed steps: tokens/s is the
trained (loss-mask) tokens over their wall time. The layouts alternate for `--repeats` runs
each (a burst of other work lands on both); the table gives the median and min-max.

Model FLOP/s: the FLOPs the step needs at least (6 x linear weights per token, 6 x n^2 x hidden
of causal attention per layer and sequence, 6 x hidden x vocab per trained token at the head;
no padding, no recomputation) over the step's wall time, as a share of the best fp32 GEMM this
process measures (`gemm_roof`: model-shaped and square matmuls, same threads).

    python benchmarks/packing.py            # ~10 min on 2 busy cores
    python benchmarks/packing.py --quick    # a tiny model, 16 trajectories: under a minute

Writes benchmarks/results/packing.md and .json (`packing_quick.*` with --quick).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from async_rl.config import Config, ModelConfig, TrainerConfig  # noqa: E402
from async_rl.models import PRINTABLE, model_config  # noqa: E402
from async_rl.trainer.backends import RankInfo, get_backend  # noqa: E402
from async_rl.trainer.batching import seq_len  # noqa: E402
from async_rl.types import Trajectory  # noqa: E402
from benchmarks.common import gemm_roof, write_results  # noqa: E402
from benchmarks.trainer_backends import synthetic_groups  # noqa: E402

ALPHABET = PRINTABLE + "\t"  # 97 characters + 3 specials: a vocabulary of 100
LAYOUTS = {"padded": False, "packed": True}


def _config(args: argparse.Namespace, packed: bool) -> Config:
    model = ModelConfig(dtype="float32", tiny_alphabet=ALPHABET, tiny_hidden=args.hidden, tiny_layers=args.layers,
                        tiny_heads=8, tiny_kv_heads=4, tiny_intermediate=args.hidden * 8 // 3 // 8 * 8,
                        max_position=args.longest + 64)
    trainer = TrainerConfig(device="cpu", compute_dtype="float32", batch_size=args.groups * 8, lr=1e-5,
                            pack_sequences=packed)
    return Config(model=model, trainer=trainer, max_staleness=1000, seed=0)


def _groups(args: argparse.Namespace, step: int) -> list[list[Trajectory]]:
    """Responses lognormal around `--median` tokens (sigma 1), cut to 4..`--longest`."""
    return synthetic_groups(2000 + step, args.groups, lambda rng: int(np.clip(
        round(args.median * math.exp(rng.normal(0.0, 1.0))), 4, args.longest)))


def model_flops(cfg: ModelConfig, trajs: list[Trajectory]) -> float:
    """Least FLOPs of one forward + backward over `trajs` (see the module docstring)."""
    h, kv = cfg.tiny_hidden, cfg.tiny_hidden // cfg.tiny_heads * cfg.tiny_kv_heads
    linear = cfg.tiny_layers * (2 * h * h + 2 * h * kv + 3 * h * cfg.tiny_intermediate)
    lengths = np.array([seq_len(t) for t in trajs], dtype=np.float64)
    trained = sum(int(t.loss_mask.sum()) for t in trajs)
    return float(6 * linear * lengths.sum() + 6 * cfg.tiny_layers * h * (lengths ** 2).sum()
                 + 6 * h * model_config(cfg).vocab_size * trained)


def computed_tokens(trainer, trajs: list[Trajectory]) -> tuple[int, int]:
    """(tokens the model runs over: padded rows count rows x longest; micro-batches) of one step."""
    micros = [m for mb in trainer._plan(trajs) for m in mb.micros]
    lengths = [[seq_len(trajs[i]) for i in m] for m in micros]
    tokens = sum(sum(ls) if trainer.packed else len(ls) * max(ls) for ls in lengths)
    return tokens, len(micros)


def run(args: argparse.Namespace, packed: bool) -> dict:
    cfg = _config(args, packed)
    trainer = get_backend("single").build(cfg, RankInfo())
    assert trainer.packed == packed
    trainer.train_step(_groups(args, 0))  # warm-up
    t0 = time.perf_counter()
    tokens = sum(trainer.train_step(_groups(args, s))["train/num_tokens"] for s in range(1, args.steps + 1))
    wall = time.perf_counter() - t0
    trajs = [[t for g in _groups(args, s) for t in g] for s in range(1, args.steps + 1)]
    computed = [computed_tokens(trainer, ts) for ts in trajs]
    return {"tokens_per_s": tokens / wall, "train_s": wall, "trained_tokens": tokens,
            "model_flops_per_s": sum(model_flops(cfg.model, ts) for ts in trajs) / wall,
            "real_tokens": sum(seq_len(t) for ts in trajs for t in ts) / args.steps,
            "computed_tokens": statistics.mean(c for c, _ in computed),
            "micro_batches": statistics.mean(n for _, n in computed)}


def _summary(runs: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return statistics.median(values), min(values), max(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8, help="prompts a step (8 answers each)")
    ap.add_argument("--median", type=int, default=48, help="median response length")
    ap.add_argument("--longest", type=int, default=768, help="longest response")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each layout, alternating")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--quick", action="store_true", help="hidden 64, 2 layers, 16 trajectories, 1 step")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.groups, args.longest, args.steps = 64, 2, 2, 256, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for k in range(args.repeats):
        for name, packed in LAYOUTS.items():
            row = run(args, packed)
            runs[name].append(row)
            print(f"run {k}: {name}: {row['tokens_per_s']:.0f} trained tokens/s, {row['micro_batches']:.1f} "
                  f"micro-batches, {row['computed_tokens']:.0f} tokens computed a step", flush=True)
    inter = args.hidden * 8 // 3 // 8 * 8
    roof, shape = gemm_roof([(2048, args.hidden, inter), (2048, inter, args.hidden), (1024, 1024, 1024)])
    base = _summary(runs["padded"], "tokens_per_s")[0]
    first = runs["padded"][0]
    lines = [f"Model: Llama-shaped, hidden {args.hidden}, {args.layers} layers, 8 heads / 4 KV heads, vocabulary "
             f"100, fp32; {args.groups * 8} trajectories a step, responses lognormal (median {args.median}, "
             f"longest {args.longest}), ~{first['real_tokens']:.0f} tokens and "
             f"~{first['trained_tokens'] / args.steps:.0f} trained tokens a step; micro-batch budget 4096 tokens; "
             f"{args.steps} timed step(s) after one warm-up; {args.threads} torch thread(s); {args.repeats} runs "
             f"of each layout, alternating: median (min-max).", "",
             "| layout | trained tokens/s | vs padded | tokens computed a step | micro-batches a step "
             "| model GFLOP/s | share of GEMM roof |", "|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        med, lo, hi = _summary(rs, "tokens_per_s")
        flops = _summary(rs, "model_flops_per_s")
        lines.append(f"| {name} | {med:.0f} ({lo:.0f}-{hi:.0f}) | {med / base:.2f}x | {rs[0]['computed_tokens']:.0f} "
                     f"| {rs[0]['micro_batches']:.1f} | {flops[0] / 1e9:.2f} "
                     f"({flops[1] / 1e9:.2f}-{flops[2] / 1e9:.2f}) | {flops[0] / roof:.1%} |")
    lines += ["", f"GEMM roof: {roof / 1e9:.1f} GFLOP/s fp32 ({shape}, {args.threads} thread(s), measured after the "
                  "runs).", "", "Load average when it ended (other processes on this machine): "
                  f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1 / 5 / 15 min)."]
    out = write_results("packing_quick" if args.quick else "packing", "\n".join(lines),
                        {"args": vars(args), "runs": runs, "gemm_roof_flops": roof, "gemm_roof_shape": shape})
    print(out.read_text())


if __name__ == "__main__":
    main()
