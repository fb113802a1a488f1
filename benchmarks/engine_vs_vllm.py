"""`benchmarks/engine_throughput.py --backend vllm`: the embedded engine and vLLM-CPU side by side
on the same machine, threads and model, offline and served, with their ratio in one table.

- Offline: the workload of `engine_throughput.py` (long-tailed `max_new_tokens`, temperature 1
  over the full vocabulary, EOS ignored) through `LLMEngine` in this process and through vLLM's
  `LLM.generate` in the vLLM environment (`vllm_env.VllmOffline`, loaded and compiled once).
- Served: vLLM's own serving benchmark (`vllm.benchmarks.serve`, OpenAI completions, random
  prompts, `--ignore-eos`, all requests at once) against `async-rl serve` and against vLLM's
  OpenAI server, both started as their users start them.

Rounds interleave the two engines and alternate which goes first (A B, B A, A B), so a host whose
speed drifts moves both alike; the ratio is taken within each round and the table gives medians
(min-max). While one engine runs the other waits idle; the CPU seconds the idle side used during
the other's rounds are recorded (`idle_cpu_s`) to show it did not compete. vLLM runs as its CPU
backend runs by default (compiled with inductor; bf16 in eager mode gives wrong tokens, see
/work/shared/VLLM.md §6.1), bound to the same cores (`VLLM_CPU_OMP_THREADS_BIND`).

Results accumulate in benchmarks/results/engine_vs_vllm.json (one entry per CPU kind, model and
dtype); engine_vs_vllm.md is rebuilt from it with each entry's command, commit and load. The servers' and
vLLM's logs go to $TMPDIR/async_rl_engine_vs_vllm/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from async_rl.config import EngineConfig, ModelConfig
from async_rl.models import PRINTABLE, load_model, load_tokenizer, model_config, model_dir
from benchmarks.common import cpu_kind, median_range
from benchmarks.vllm_bench_serve import git_commit
from benchmarks.vllm_env import VllmOffline, bench_serve, embedded_server, vllm_python, vllm_server, vllm_version


def log_dir() -> Path:
    """Where the servers' and vLLM's logs go (not the results folder): a fixed folder under the temp dir."""
    path = Path(tempfile.gettempdir()) / "async_rl_engine_vs_vllm"
    path.mkdir(parents=True, exist_ok=True)
    return path


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by a process and its descendants."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def interleaved(rounds: int, a, b) -> list[tuple[dict, dict]]:
    """`rounds` pairs (a(), b()), alternating which runs first."""
    out = []
    for r in range(rounds):
        if r % 2 == 0:
            ra = a()
            rb = b()
        else:
            rb = b()
            ra = a()
        out.append((ra, rb))
    return out


def offline(args, python, work, useful: int) -> dict:
    from benchmarks.engine_throughput import run_engine  # the same engine run as the HF comparison

    mc = ModelConfig(name=args.model, dtype=args.dtype, tiny_alphabet=PRINTABLE, max_position=1024)
    model = load_model(mc, seed=args.seed, tokenizer=load_tokenizer(mc), device="cpu")
    cfg = EngineConfig(kv_cache_mb=args.kv_cache_mb, max_running=args.max_running,
                       max_tokens_per_step=args.max_tokens_per_step, enable_prefix_caching=True)
    with VllmOffline(python, model_dir(mc), work, dtype=args.dtype, threads=args.threads,
                     log=log_dir() / "vllm_offline.log") as vllm:
        vllm.run(warm=8)
        run_engine(model, cfg, work[:8], "warm-up")

        def embedded() -> dict:
            load, idle0 = os.getloadavg()[0], tree_cpu_s(vllm.proc.pid)
            seconds = run_engine(model, cfg, work, "embedded")[0]
            return {"tok_s": useful / seconds, "seconds": seconds, "load": load,
                    "idle_cpu_s": tree_cpu_s(vllm.proc.pid) - idle0}

        def other() -> dict:
            load, c0 = os.getloadavg()[0], time.process_time()
            res = vllm.run()
            assert res["generated"] == useful, (res, useful)
            return {"tok_s": useful / res["seconds"], "seconds": res["seconds"], "load": load,
                    "idle_cpu_s": time.process_time() - c0}

        pairs = interleaved(args.repeats, embedded, other)
    for r, (e, v) in enumerate(pairs, 1):
        print(f"offline round {r}: embedded {e['tok_s']:.1f} tok/s, vLLM {v['tok_s']:.1f} tok/s "
              f"({e['tok_s'] / v['tok_s']:.2f}x; load {e['load']:.1f})", flush=True)
    return summary(pairs, f"{len(work)} requests, {sum(len(p) for p, _ in work)} prompt / {useful} generated "
                          f"tokens, long-tailed, T=1, EOS ignored")


def served(args, python) -> dict:
    from benchmarks.vllm_bench_serve import client_args, server_overrides

    tokenizer = model_dir(ModelConfig(name=args.model))
    args = argparse.Namespace(**{**vars(args), "num_prompts": args.served_prompts, "override": []})
    client = client_args(args)
    logs = log_dir()
    with embedded_server(server_overrides(args), log=logs / "embedded_server.log") as emb, \
            vllm_server(python, tokenizer, dtype=args.dtype, threads=args.threads,
                        log=logs / "vllm_server.log") as vll:

        def one(server, idle) -> dict:
            load, idle0 = os.getloadavg()[0], tree_cpu_s(idle.pid)
            res = bench_serve(python, server.url, tokenizer, client)
            if res["completed"] != args.num_prompts:
                raise RuntimeError(f"{server.url}: {res['completed']}/{args.num_prompts} requests completed "
                                   f"({res.get('errors', [])[:1]})")
            return {"tok_s": res["output_throughput"], "seconds": res["duration"], "load": load,
                    "idle_cpu_s": tree_cpu_s(idle.pid) - idle0,
                    "median_ttft_ms": res["median_ttft_ms"], "median_tpot_ms": res["median_tpot_ms"]}
        pairs = interleaved(args.repeats, lambda: one(emb, vll), lambda: one(vll, emb))
    for r, (e, v) in enumerate(pairs, 1):
        print(f"served round {r}: embedded {e['tok_s']:.1f} tok/s, vLLM {v['tok_s']:.1f} tok/s "
              f"({e['tok_s'] / v['tok_s']:.2f}x; load {e['load']:.1f})", flush=True)
    return summary(pairs, f"vLLM's serving benchmark: {args.num_prompts} random prompts of {args.input_len} tokens, "
                          f"{args.output_len} out, EOS ignored, all at once")


def summary(pairs: list[tuple[dict, dict]], workload: str) -> dict:
    def spread(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}
    return {"workload": workload, "embedded": [e for e, _ in pairs], "vllm": [v for _, v in pairs],
            "embedded_tok_s": spread([e["tok_s"] for e, _ in pairs]),
            "vllm_tok_s": spread([v["tok_s"] for _, v in pairs]),
            "ratio": spread([e["tok_s"] / v["tok_s"] for e, v in pairs]),
            "load": [min(x["load"] for p in pairs for x in p), max(x["load"] for p in pairs for x in p)]}


def measure_vllm(args) -> dict:
    python = vllm_python(args.vllm_python)
    from benchmarks.engine_throughput import workload

    vocab = model_config(ModelConfig(name=args.model)).vocab_size  # the HF comparison's vocabulary (the embedding's rows)
    work = workload(vocab, args.num_prompts, args.quick, args.seed)
    useful = sum(m for _, m in work)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    modes = {}
    if "offline" in args.modes:
        modes["offline"] = offline(args, python, work, useful)
    if "served" in args.modes:
        modes["served"] = served(args, python)
    return {"model": args.model, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
            "modes": modes, "vllm": vllm_version(python), "cpu": cpu_kind(), "commit": git_commit(),
            "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def table(entries: dict) -> str:
    lines = ["| CPU | model, dtype, threads | mode | workload | embedded tok/s | vLLM-CPU tok/s | embedded ÷ vLLM | "
             "load avg | commit |", "|---|---|---|---|---|---|---|---|---|"]
    for e in entries.values():
        for mode, m in e["modes"].items():
            lines.append(f"| {e['cpu']} | {e['model']}, {e['dtype']}, {e['threads']} | {mode} | {m['workload']} | "
                         f"{median_range(m['embedded_tok_s']['values'], '.1f')} | "
                         f"{median_range(m['vllm_tok_s']['values'], '.1f')} | "
                         f"**{median_range(m['ratio']['values'], '.2f')}x** | {m['load'][0]:.1f}-{m['load'][1]:.1f} | "
                         f"{e['commit']} |")
    return "\n".join(lines)


def write_vllm(entry: dict, results: Path) -> dict:
    results.mkdir(parents=True, exist_ok=True)
    path = results / "engine_vs_vllm.json"
    entries = json.loads(path.read_text()) if path.is_file() else {}
    entries[f"{entry['cpu']}/{entry['model']}/{entry['dtype']}"] = entry
    path.write_text(json.dumps(entries, indent=2) + "\n")
    md = ["# The embedded engine against vLLM-CPU", "",
          "Generated tokens/s, medians (min-max) of interleaved rounds; the ratio is taken within each round. "
          "See benchmarks/engine_vs_vllm.py. Load avg: the host's 1-minute load average at the rounds' starts "
          "(2 cores: above ~2 something else ran).", "", table(entries), "", "Commands:", ""]
    md += [f"- `{e['command']}` ({e['cpu']}; {e['vllm']}; torch {e['torch']}; {e['date']})" for e in entries.values()]
    (results / "engine_vs_vllm.md").write_text("\n".join(md) + "\n")
    return entries
