"""Where the engine's time goes on the engine_throughput workload, and what its GEMMs allow.

Two measurements, in one process, on the model and dtype `engine_throughput.py` uses:
- **The step, split.** The long-tailed workload of `engine_throughput.py` (128 requests, all at once)
  runs once through `LLMEngine` with its parts timed in place: the linear layers (`_Linear.whole`,
  the GEMMs of q/k/v, o, gate/up, down and the LM head), decode attention (`_slab_attention`,
  `_decode_attention`), the step's layout (`prepare`), RMS norms, rotary, decode KV writes into the
  slab, sampling (`Sampler.__call__`); the rest of `ModelRunner.run` (pool KV writes, prefill attention,
  SiLU x up, residuals: element-wise ops and Python) and the rest of `step` (scheduling, bookkeeping). Each part's share of the wall time, the GEMMs' FLOP/s, and the share of
  the GEMM roof the run would reach if everything but the GEMMs and decode attention took no time:
  the ceiling the present kernels put on `engine_throughput.py`'s "share of GEMM roof".
- **The GEMMs by rows.** The engine's own linear layers (`_Linear`, with its choice of kernel per row
  count) over all layers, once per call, at 1-512 rows: GFLOP/s, share of the roof, GB/s of weights
  read (every layer's weights once per pass: what a decode step reads), against the memory read
  bandwidth of the same threads (a sum over 512 MB).

    python benchmarks/engine_ceiling.py --model smollm2-135m --dtype float32

Results: benchmarks/results/engine_ceiling.md and .json (the last run).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import async_rl  # noqa: F401  (before torch: OpenMP threads wait passively, async_rl/__init__.py)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from async_rl.config import EngineConfig, ModelConfig  # noqa: E402
from async_rl.engine import decode_slab, model_runner, sampler  # noqa: E402
from async_rl.models import PRINTABLE, load_model, load_tokenizer  # noqa: E402
from benchmarks.common import gemm_roof, write_results  # noqa: E402
from benchmarks.engine_throughput import model_flops, roof_shapes, run_engine, workload  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Clock:
    """Seconds spent in the wrapped callables, by name (a wrapped call inside another counts in both: the
    split subtracts the inner parts from the outer), and the FLOPs of the wrapped GEMMs."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.flops = 0.0
        self._undo: list = []

    def wrap(self, owner, attr: str, name: str, flops=None) -> None:
        inner = getattr(owner, attr)
        clock = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            clock.seconds[name] += time.perf_counter() - t0
            clock.calls[name] += 1
            if flops is not None:
                clock.flops += flops(*args)
            return out

        static = inspect.getattr_static(owner, attr)
        setattr(owner, attr, staticmethod(timed) if isinstance(static, staticmethod) else timed)
        self._undo.append((owner, attr, static))

    def unwrap(self) -> None:
        for owner, attr, inner in reversed(self._undo):
            setattr(owner, attr, inner)
        self._undo.clear()


def _linear_flops(lin, h) -> float:
    return 2.0 * h.shape[0] * sum(m.weight.numel() for m in lin.linears)


def split_step(model, work, cfg: EngineConfig) -> dict:
    """One run of the workload with the engine's parts timed in place."""
    clock = Clock()
    runner_cls = model_runner.ModelRunner
    clock.wrap(model_runner._Linear, "whole", "gemm", _linear_flops)
    clock.wrap(runner_cls, "_slab_attention", "decode_attention")
    clock.wrap(runner_cls, "_decode_attention", "decode_attention")
    clock.wrap(runner_cls, "run", "runner")
    clock.wrap(runner_cls, "prepare", "prepare")
    clock.wrap(runner_cls, "_rms_norm", "rms_norm")
    clock.wrap(runner_cls, "_rotate", "rotary")
    clock.wrap(decode_slab.DecodeSlab, "write", "slab_write")
    clock.wrap(sampler.Sampler, "__call__", "sampling")
    try:
        wall, _, _ = run_engine(model, cfg, work, "engine, parts timed")
    finally:
        clock.unwrap()
    s = clock.seconds
    parts = {"GEMMs (linear layers, LM head)": s["gemm"], "decode attention": s["decode_attention"],
             "step layout (`prepare`: token, slot and attention tables, slab rows)": s["prepare"],
             "RMS norms": s["rms_norm"], "rotary": s["rotary"], "decode KV writes into the slab": s["slab_write"],
             "rest of the forward (pool KV writes, prefill attention, SiLU x up, residuals, Python)":
                 s["runner"] - s["gemm"] - s["decode_attention"] - s["prepare"] - s["rms_norm"] - s["rotary"]
                 - s["slab_write"],
             "sampling": s["sampling"], "rest of the step (scheduling, bookkeeping)": wall - s["runner"] - s["sampling"]}
    return {"wall_s": wall, "steps": clock.calls["runner"], "parts_s": parts, "gemm_flops": clock.flops}


def gemm_rows(model, rows: tuple[int, ...], reps: int) -> list[dict]:
    """The engine's linear layers over all layers (one call each, as a step makes them) at each row count."""
    runner = model_runner.ModelRunner(model, num_blocks=2, block_size=16, decode_slab=False)
    lins = [lin for li in range(runner.num_layers)
            for lin in (runner.qkv[li], runner.o_proj[li], runner.gate_up[li], runner.down[li])] + [runner.lm_head]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for lin in lins for m in lin.linears)
    out = []
    with torch.no_grad():
        for m in rows:
            xs = {lin: torch.randn(m, lin.linears[0].weight.shape[1], dtype=runner.dtype) for lin in lins}
            flops = sum(_linear_flops(lin, xs[lin]) for lin in lins)
            for lin in lins:  # warm-up (and packing on first use)
                lin.whole(xs[lin])
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for lin in lins:
                    lin.whole(xs[lin])
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            out.append({"rows": m, "seconds": t, "gflops": flops / t / 1e9, "weights_gb_s": weight_bytes / t / 1e9})
    return out


def read_bandwidth(reps: int = 5) -> float:
    x = torch.ones(128 * 2**20)  # 512 MB
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="tiny | smollm2-135m | checkpoint dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--kv-cache-mb", type=float, default=512.0)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="passes over the layers per row count (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS), help="row counts of the GEMM table (none: skip it)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(args.seed)
    mc = ModelConfig(name=args.model, dtype=args.dtype, tiny_alphabet=PRINTABLE, max_position=1024)
    model = load_model(mc, seed=args.seed, tokenizer=load_tokenizer(mc))
    dtype = next(model.parameters()).dtype
    work = workload(model.get_input_embeddings().weight.shape[0], args.num_prompts, False, args.seed)
    cfg = EngineConfig(kv_cache_mb=args.kv_cache_mb, max_running=args.max_running, max_tokens_per_step=2048,
                       enable_prefix_caching=True)
    split_step(model, work[:8], cfg)  # warm-up: one-off allocations and packing
    split = split_step(model, work, cfg)
    roof, shape = gemm_roof(roof_shapes(model), dtype)
    by_rows = gemm_rows(model, tuple(args.rows), args.reps)
    bandwidth = read_bandwidth()
    flops = model_flops(model, work)
    wall, parts = split["wall_s"], split["parts_s"]
    kernels = parts["GEMMs (linear layers, LM head)"] + parts["decode attention"]
    lines = [f"Workload: {len(work)} long-tailed requests of `engine_throughput.py`, {sum(m for _, m in work)} "
             f"useful tokens, {split['steps']} engine steps; {args.model} in {str(dtype)[6:]}, "
             f"{torch.get_num_threads()} threads, max_running={args.max_running}.", "",
             "| part of the run | seconds | share of wall |", "|---|---|---|"]
    lines += [f"| {name} | {s:.2f} | {s / wall:.1%} |" for name, s in parts.items()]
    lines += [f"| **wall** | {wall:.2f} | 100% |", "",
              f"GEMM roof: {roof / 1e9:.0f} GFLOP/s ({shape}). The GEMMs ran {split['gemm_flops'] / 1e12:.2f} TFLOP "
              f"at {split['gemm_flops'] / parts['GEMMs (linear layers, LM head)'] / 1e9:.0f} GFLOP/s "
              f"({split['gemm_flops'] / parts['GEMMs (linear layers, LM head)'] / roof:.0%} of the roof).",
              f"Share of the roof as `engine_throughput.py` counts it ({flops / 1e12:.2f} TFLOP over the wall time): "
              f"**{flops / wall / roof:.1%}**; with every part but the GEMMs and decode attention taking no time: "
              f"**{flops / kernels / roof:.1%}**.", "",
              f"Memory read bandwidth of the same threads: {bandwidth:.1f} GB/s."]
    if by_rows:
        lines += ["", f"The engine's linear layers, every layer once (weights "
                  f"{by_rows[0]['weights_gb_s'] * by_rows[0]['seconds']:.2f} GB):", "",
                  "| rows | ms per pass | GFLOP/s | share of roof | weights GB/s |", "|---|---|---|---|---|"]
        lines += [f"| {r['rows']} | {r['seconds'] * 1e3:.1f} | {r['gflops']:.0f} | {r['gflops'] * 1e9 / roof:.0%} | "
                  f"{r['weights_gb_s']:.1f} |" for r in by_rows]
    md = "\n".join(lines)
    print(md)
    write_results("engine_ceiling", md, {"split": split, "roof": roof, "roof_shape": shape, "gemm_rows": by_rows,
                                         "read_gb_s": bandwidth, "model_flops": flops, "model": args.model,
                                         "dtype": str(dtype)})


if __name__ == "__main__":
    main()
