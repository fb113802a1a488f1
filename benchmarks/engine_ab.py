"""Decode steps of this checkout's engine against another commit's, interleaved in one process.

The machines these benchmarks run on drift by tens of percent within minutes, so two engines timed
one after the other say little. Here both engines hold the same `--sequences` requests (random prompts of
`--context` tokens, SmolLM2-135M by default, sampled with per-request seeds) in one process; once every
request decodes, rounds alternate between them (`--steps-per-round` decode steps each, the order flipped
every round) and each round's base/this ratio is kept. The base commit's `async_rl/engine/model_runner.py`
and `decode_slab.py` are read with `git show` and run beside this checkout's scheduler, sampler and model.

    python benchmarks/engine_ab.py --base 739bb46 --sequences 64 --context 150 --rounds 8
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import async_rl  # noqa: F401  (before torch: OpenMP threads wait passively, async_rl/__init__.py)
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_results  # noqa: E402
from benchmarks.engine_throughput import spread  # noqa: E402
from async_rl.config import EngineConfig, ModelConfig  # noqa: E402
from async_rl.engine import llm_engine  # noqa: E402
from async_rl.models import load_model, load_tokenizer  # noqa: E402
from async_rl.types import SamplingParams  # noqa: E402

BASE_SLAB = "base_decode_slab"


def base_runner(commit: str, where: Path) -> type:
    """The ModelRunner class of `commit`, importing that commit's decode slab."""
    def source(path: str) -> str:
        got = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True)
        if got.returncode != 0:
            sys.exit(f"error: --base {commit}: {got.stderr.strip().splitlines()[-1] if got.stderr.strip() else 'git show failed'}")
        return got.stdout

    def load(name: str, text: str):
        path = where / f"{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    load(BASE_SLAB, source("async_rl/engine/decode_slab.py"))
    runner = source("async_rl/engine/model_runner.py").replace("from async_rl.engine.decode_slab import",
                                                               f"from {BASE_SLAB} import")
    base = load("base_model_runner", runner).ModelRunner
    takes = len(inspect.signature(base.__init__).parameters) - 1  # a base older than this checkout's engine
    # passes fewer arguments (before engine.cpu_kernels: model, blocks, block size, decode slab)

    class Base(base):
        def __init__(self, *args):
            super().__init__(*args[:takes])

    return Base


def decoding_engine(model, cfg: EngineConfig, runner_cls: type, n: int, context: int) -> llm_engine.LLMEngine:
    """An engine (with `runner_cls`) whose n requests have all been prefilled and decode."""
    own = llm_engine.ModelRunner
    llm_engine.ModelRunner = runner_cls
    try:
        engine = llm_engine.LLMEngine(model, cfg)
    finally:
        llm_engine.ModelRunner = own
    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    for i in range(n):
        engine.add_request(f"r{i}", torch.randint(3, vocab, (context,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=min(4096, model.config.max_position_embeddings - context),
                                          temperature=1.0, ignore_eos=True, seed=i))
    while not (len(engine.scheduler.running) == n and all(len(s.token_ids) > context for s in engine.scheduler.running)):
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit whose engine is compared with this checkout's")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--kv-cache-mb", type=float, default=512.0)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps-per-round", type=int, default=4)
    ap.add_argument("--name", default="engine_ab")
    ap.add_argument("--cpu-kernels", default="auto", help="engine.cpu_kernels of this checkout's engine")
    ap.add_argument("--base-cpu-kernels", default="auto", help="engine.cpu_kernels of the base engine (torch: a base "
                                                                "older than a kernel change runs torch's ops)")
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    tmp = tempfile.TemporaryDirectory()
    base_cls = base_runner(args.base, Path(tmp.name))  # a wrong commit fails here, before the model loads
    mc = ModelConfig(name=args.model, dtype=args.dtype, max_position=2048)
    model = load_model(mc, seed=0, tokenizer=load_tokenizer(mc))
    cfg = EngineConfig(kv_cache_mb=args.kv_cache_mb, max_running=args.sequences, max_tokens_per_step=2048,
                       enable_prefix_caching=False)
    tokens = args.context + args.rounds * args.steps_per_round + 2 * cfg.block_size  # per sequence, at the end
    needed = args.sequences * tokens * llm_engine.ModelRunner.bytes_per_block(model, 1)
    if needed > args.kv_cache_mb * 2**20:
        sys.exit(f"error: --kv-cache-mb {args.kv_cache_mb:g} cannot hold {args.sequences} sequences of "
                 f"~{args.context} tokens ({needed / 2**20:.0f} MB): they would be preempted, not timed")
    engines = {"this": decoding_engine(model, dataclasses.replace(cfg, cpu_kernels=args.cpu_kernels),
                                       llm_engine.ModelRunner, args.sequences, args.context),
               "base": decoding_engine(model, dataclasses.replace(cfg, cpu_kernels=args.base_cpu_kernels), base_cls,
                                       args.sequences, args.context)}
    ms: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds):
        for k in (("this", "base") if r % 2 == 0 else ("base", "this")):
            t0 = time.perf_counter()
            for _ in range(args.steps_per_round):
                engines[k].step()
            ms[k].append((time.perf_counter() - t0) / args.steps_per_round * 1000)
    tmp.cleanup()
    per_round = [b / t for b, t in zip(ms["base"], ms["this"])]
    ratios = spread(per_round)
    stats = {k: {s: v for s, v in e.stats().items() if "slab" in s} for k, e in engines.items()}
    row = (f"| {args.sequences} | {args.context} | {args.kv_cache_mb:g} | {spread(ms['this'])['median']:.0f} | "
           f"{spread(ms['base'])['median']:.0f} | **{ratios['median']:.2f}x** ({ratios['min']:.2f}-"
           f"{ratios['max']:.2f}) | {stats['this'].get('engine/slab_pool_steps', 0):g} / "
           f"{stats['base'].get('engine/slab_pool_steps', 0):g} |")
    table = ("| sequences | context | KV MB | this checkout ms/step | base ms/step | base / this, per round "
             "(median, min-max) | slab pool steps this / base |\n|---|---|---|---|---|---|---|\n" + row)
    print(table)
    write_results(args.name, f"{args.model} {args.dtype}, base {args.base} (cpu_kernels {args.base_cpu_kernels}) "
                  f"against this checkout (cpu_kernels {args.cpu_kernels}), {args.rounds} rounds of "
                  f"{args.steps_per_round} decode steps each engine, interleaved.\n\n{table}",
                  {"args": vars(args), "ms_this": ms["this"], "ms_base": ms["base"], "ratios": per_round, "ratio": ratios, "stats": stats})


if __name__ == "__main__":
    main()
