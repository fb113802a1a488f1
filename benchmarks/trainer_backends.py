"""Trained tokens per second of the `single`, `fsdp` and `megatron` trainer backends on one workload,
and the time to publish a version from each.

Every case trains the same fixed batches (8 prompts x 8 answers, prompts of 16-32 tokens,
responses of 16-64, a tenth of response tokens masked out as tool output) on the same
Llama-shaped model built from the seed (`--hidden`, `--layers`; 8 heads, 4 KV heads, vocabulary
100), fp32, one minibatch, micro-batches of `--micro-tokens` tokens (single and fsdp pack them,
megatron pads them: `trainer.pack_sequences`; benchmarks/packing.py compares the two layouts).
Every process runs `--threads` torch threads (default 1: on a machine shared with other work, a
multi-threaded process loses most of its time waiting for its slowest thread), so a 2-rank case
uses twice the cores of a 1-process one; the table also gives tokens/s per process. A case
runs one warm-up step, then `--steps` timed steps: tokens/s is the trained (loss-mask) tokens
over their wall time. Publish: the weights of a version gathered (and, for megatron, converted
to HF names) and written by the `disk` publisher, as `async-rl run` publishes after each step;
median of 3. The cases run round-robin `--repeats` times (3), so drift on the machine hits every
case alike, and each reports the median of its rounds with their min-max.

    python benchmarks/trainer_backends.py            # about 6 min on 2 cores
    python benchmarks/trainer_backends.py --quick    # a smaller model, fewer steps

Writes benchmarks/results/trainer_backends.md and .json with the command line and the machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from async_rl.config import Config, ModelConfig, TrainerConfig  # noqa: E402
from async_rl.models import PRINTABLE  # noqa: E402
from async_rl.trainer.backends import RankInfo, get_backend  # noqa: E402
from async_rl.types import Trajectory  # noqa: E402
from async_rl.weight_sync.disk import DiskWeightPublisher  # noqa: E402
from benchmarks.common import write_results  # noqa: E402
from async_rl.launch.common import free_port  # noqa: E402

CASES = {  # name -> (backend, world_size, tensor_parallel)
    "single": ("single", 1, 1),
    "fsdp 2 ranks": ("fsdp", 2, 1),
    "megatron TP=1": ("megatron", 1, 1),
    "megatron TP=2": ("megatron", 2, 2),
    "megatron TP=1 x DP=2": ("megatron", 2, 1),
}
ALPHABET = PRINTABLE + "\t"  # 97 characters + 3 specials: a vocabulary of 100


def _config(args: argparse.Namespace, backend: str, world: int, tp: int) -> Config:
    model = ModelConfig(dtype="float32", tiny_alphabet=ALPHABET, tiny_hidden=args.hidden, tiny_layers=args.layers,
                        tiny_heads=8, tiny_kv_heads=4, tiny_intermediate=args.hidden * 8 // 3 // 8 * 8,
                        max_position=256)
    trainer = TrainerConfig(backend=backend, world_size=world, tensor_parallel=tp, device="cpu",
                            compute_dtype="float32", batch_size=64, micro_batch_tokens=args.micro_tokens, lr=1e-5)
    return Config(model=model, trainer=trainer, max_staleness=100, seed=0)


def _groups(step: int) -> list[list[Trajectory]]:
    return synthetic_groups(1000 + step, 8, lambda rng: int(rng.integers(16, 65)))


def synthetic_groups(seed: int, groups: int, response_len: Callable[[np.random.Generator], int]) \
        -> list[list[Trajectory]]:
    """`groups` prompts of 16-32 tokens x 8 answers of `response_len(rng)` tokens over a vocabulary of 100,
    a tenth of response tokens masked out as tool output, rewards 0/1, sampled by version 0."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, 100, size=int(rng.integers(16, 33))).astype(np.int32)
        group = []
        for i in range(8):
            r = response_len(rng)
            mask = (rng.random(r) > 0.1).astype(np.uint8)
            group.append(Trajectory(
                id=f"s{seed}g{g}i{i}", group_id=f"s{seed}g{g}", prompt_ids=prompt,
                response_ids=rng.integers(3, 100, size=r).astype(np.int32), loss_mask=mask,
                behav_logprobs=np.where(mask, -rng.uniform(1.0, 5.0, size=r), 0.0).astype(np.float32),
                versions=np.zeros(r, dtype=np.int32), reward=float(rng.random() > 0.5), finish_reason="stop"))
        out.append(group)
    return out


def _rank_main(rank: int, world: int, cfg: Config, steps: int, threads: int, port: int, out: str,
               errors) -> None:
    try:
        torch.set_num_threads(threads)
        spec = get_backend(cfg.trainer.backend)
        store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=False) \
            if spec.distributed else None
        trainer = spec.build(cfg, RankInfo(rank, world, store, timeout_s=600))

        def step(s: int) -> dict:
            return trainer.train_step(_groups(s)) if rank == 0 else trainer.follow_train_step()

        step(0)  # warm-up
        t0 = time.perf_counter()
        tokens = sum(step(s).get("train/num_tokens", 0.0) for s in range(1, steps + 1))
        train_s = time.perf_counter() - t0
        publish = []
        with tempfile.TemporaryDirectory() as tmp:
            publisher = DiskWeightPublisher(Path(tmp), keep_last=2)
            for v in range(3):
                t0 = time.perf_counter()
                weights = trainer.state_dict()
                if rank == 0:
                    publisher.publish(weights, v + 1)
                del weights
                publish.append(time.perf_counter() - t0)
        if rank == 0:
            torch.save({"tokens": tokens, "train_s": train_s, "publish_s": statistics.median(publish)}, out)
        trainer.close()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def run_case(args: argparse.Namespace, name: str, tmp: Path) -> dict:
    backend, world, tp = CASES[name]
    cfg = _config(args, backend, world, tp)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port, out = free_port(), tmp / f"{backend}{world}{tp}.pt"
    procs = [ctx.Process(target=_rank_main, args=(r, world, cfg, args.steps, args.threads, port, str(out), errors))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1200)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(errors.get(timeout=5) if not errors.empty() else f"{name}: a rank failed or hung")
    r = torch.load(out)
    return {"case": name, "backend": backend, "world_size": world, "tensor_parallel": tp,
            "tokens_per_s": r["tokens"] / r["train_s"], "train_s": r["train_s"], "tokens": r["tokens"],
            "publish_s": r["publish_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over all cases; each reports its median")
    ap.add_argument("--quick", action="store_true", help="hidden 128, 2 layers, 2 steps")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.steps, args.repeats = 128, 2, 2, 1
    if args.repeats < 1:
        raise SystemExit("error: --repeats must be at least 1")
    rounds: dict[str, list[dict]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            for name in CASES:
                row = run_case(args, name, Path(tmp))
                print(f"round {round_}: {name}: {row['tokens_per_s']:.0f} trained tokens/s, "
                      f"publish {row['publish_s']:.3f} s", flush=True)
                rounds[name].append(row)
    rows = [{**runs[0], "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
             "tokens_per_s_min": min(r["tokens_per_s"] for r in runs),
             "tokens_per_s_max": max(r["tokens_per_s"] for r in runs),
             "publish_s": statistics.median(r["publish_s"] for r in runs), "rounds": runs}
            for runs in rounds.values()]
    base = rows[0]["tokens_per_s"]
    lines = [f"Model: Llama-shaped, hidden {args.hidden}, {args.layers} layers, 8 heads / 4 KV heads, vocabulary 100, "
             f"fp32; 64 trajectories a step (~{rows[0]['tokens'] / args.steps:.0f} trained tokens), one minibatch, "
             f"micro-batches of {args.micro_tokens} tokens (single, fsdp: packed; megatron: padded rows x longest); "
             f"{args.steps} timed steps after one warm-up; "
             f"{args.threads} torch thread(s) per process; median (min-max) of {args.repeats} rounds.", "",
             "| backend | processes | trained tokens/s | vs single | per process | publish (gather + disk) s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['world_size']} | {r['tokens_per_s']:.0f} "
                     f"({r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f}) | {r['tokens_per_s'] / base:.2f}x "
                     f"| {r['tokens_per_s'] / r['world_size']:.0f} | {r['publish_s']:.3f} |")
    lines += ["", f"Load average when it ended (other processes on this machine): "
                  f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1 / 5 / 15 min)."]
    out = write_results("trainer_backends", "\n".join(lines), {"args": vars(args), "rows": rows,
                                                               "loadavg": os.getloadavg()})
    print(out.read_text())


if __name__ == "__main__":
    main()
