"""Decode steps of the embedded engine with OpenMP threads spinning (libgomp's default) and passive
(`OMP_WAIT_POLICY=PASSIVE`, what importing async_rl sets): whole processes, alternating.

libgomp reads the policy once, when torch loads it, so each measurement is a fresh process: it
builds an engine whose `--sequences` requests (random prompts of `--context` tokens) all decode,
then times `--steps` decode steps and prints their median. Rounds alternate the two policies and
flip their order; the ratio is taken within each round. The load average at each start is kept:
the effect is the cores being shared (other processes, or trainer and engine), so it is large on a
loaded machine and small on a quiet one.

    python benchmarks/wait_policy.py --rounds 3 --sequences 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import async_rl  # noqa: F401  (before torch: sets the wait policy unless the environment gives one)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))



def child(args) -> None:
    import torch

    from async_rl.config import EngineConfig, ModelConfig
    from async_rl.engine import llm_engine
    from async_rl.models import load_model, load_tokenizer
    from benchmarks.engine_ab import decoding_engine

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    mc = ModelConfig(name=args.model, dtype=args.dtype, max_position=2048)
    model = load_model(mc, seed=0, tokenizer=load_tokenizer(mc))
    cfg = EngineConfig(kv_cache_mb=512, max_running=args.sequences, enable_prefix_caching=False)
    engine = decoding_engine(model, cfg, llm_engine.ModelRunner, args.sequences, args.context)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1000)
    print(json.dumps({"ms": statistics.median(times), "policy": os.environ.get("OMP_WAIT_POLICY", "unset")}))


def one(args, policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env["OMP_WAIT_POLICY"] = ""  # set but empty: async_rl leaves it, libgomp takes its default (spin)
    load = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype,
           "--sequences", str(args.sequences), "--context", str(args.context), "--steps", str(args.steps)]
    out = subprocess.run(cmd, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"error: the {policy} run failed: {out.stderr.strip().splitlines()[-1:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "load": load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="wait_policy")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from benchmarks.common import cpu_kind, median_range, write_results

    rounds = []
    for r in range(args.rounds):
        order = ("spin", "passive") if r % 2 == 0 else ("passive", "spin")
        got = {p: one(args, p) for p in order}
        rounds.append(got)
        print(f"round {r + 1}: spin {got['spin']['ms']:.0f} ms/step, passive {got['passive']['ms']:.0f} ms/step "
              f"(load {got['spin']['load']:.1f}, {got['passive']['load']:.1f})", flush=True)
    ratio = [g["spin"]["ms"] / g["passive"]["ms"] for g in rounds]
    loads = [g[p]["load"] for g in rounds for p in g]
    table = ("| sequences | context | spin ms/step | passive ms/step | spin / passive, per round | load avg |\n"
             "|---|---|---|---|---|---|\n"
             f"| {args.sequences} | {args.context} | {median_range([g['spin']['ms'] for g in rounds], '.0f')} | "
             f"{median_range([g['passive']['ms'] for g in rounds], '.0f')} | **{median_range(ratio, '.2f')}x** | "
             f"{min(loads):.1f}-{max(loads):.1f} |")
    print(table)
    write_results(args.name, f"{args.model} {args.dtype}, {cpu_kind()}, {args.rounds} rounds of one process per "
                  f"policy, {args.steps} decode steps each (median).\n\n{table}",
                  {"args": vars(args), "rounds": rounds, "ratio": ratio})


if __name__ == "__main__":
    main()
