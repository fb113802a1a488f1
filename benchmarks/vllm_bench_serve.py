"""vLLM's own serving benchmark, unmodified, against `async-rl serve`: does a client written for
vLLM get every request answered, and at what rate.

The client is `vllm.benchmarks.serve` from the vLLM environment (see `benchmarks/vllm_env.py` for
why it is driven through `add_cli_args`/`main` rather than `vllm bench serve`) with the OpenAI
completions backend: each request streams a text prompt with `repetition_penalty: 1.0`,
`logprobs: null`, `stream_options.include_usage` and, with --ignore-eos, `ignore_eos`
(`vllm/benchmarks/lib/endpoint_request_func.py`). The server is `async-rl serve` started as a
user starts it, in its own process. Each round is a fresh server; the table gives every round
and the median (min-max) of output tokens/s.

    python benchmarks/vllm_bench_serve.py                 # smollm2-135m bf16, 64 prompts 128 in / 128 out, 3 rounds
    python benchmarks/vllm_bench_serve.py --rounds 1 --num-prompts 8 --vllm-python .venv-vllm/bin/python

Not part of `make test`: the vLLM environment is not in CI. Results: benchmarks/results/vllm_bench_serve.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_kind, median_range  # noqa: E402
from benchmarks.vllm_env import bench_serve, embedded_server, vllm_python, vllm_version  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def client_args(args) -> list[str]:
    return ["--backend", "openai", "--endpoint", "/v1/completions", "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--ignore-eos", "--request-rate", "inf", "--seed", str(args.seed)]


def server_overrides(args) -> list[str]:
    return [f"model.name={args.model}", f"model.dtype={args.dtype}", f"engine.num_threads={args.threads}",
            f"engine.kv_cache_mb={args.kv_cache_mb}", "run_dir=/tmp/async_rl_vllm_bench_serve", *args.override]


def keep(r: dict) -> dict:
    names = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
             "request_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms")
    out = {k: r.get(k) for k in names}
    out["errors"] = sorted({e.splitlines()[-1][:200] for e in r.get("errors", []) if e})[:5]
    return out


def measure(args) -> dict:
    python = vllm_python(args.vllm_python)
    from async_rl.models import smollm2_checkpoint

    tokenizer = smollm2_checkpoint() if args.model == "smollm2-135m" else Path(args.model)
    rounds = []
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        with embedded_server(server_overrides(args)) as server:
            res = keep(bench_serve(python, server.url, tokenizer, client_args(args)))
        res["load_before"], res["load_after"] = load, os.getloadavg()[0]
        rounds.append(res)
        print(f"round {r + 1}: {res['completed']}/{args.num_prompts} completed, {res['failed']} failed, "
              f"{res['output_throughput']:.1f} output tok/s (load {load:.1f} -> {res['load_after']:.1f})", flush=True)
    tps = [r["output_throughput"] for r in rounds]
    return {"model": args.model, "dtype": args.dtype, "threads": args.threads, "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len, "rounds": rounds,
            "output_tok_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)},
            "all_completed": all(r["completed"] == args.num_prompts and not r["failed"] for r in rounds),
            "client": vllm_version(python) + " vllm.benchmarks.serve " + " ".join(client_args(args)),
            "server": "async-rl serve -c configs/smollm2_arith.yaml " + " ".join(server_overrides(args)),
            "commit": git_commit(), "cpu": cpu_kind(), "cores": len(os.sched_getaffinity(0)),
            "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def git_commit() -> str:
    """HEAD, with "-dirty" when the tree has uncommitted changes (the code measured is not HEAD's)."""
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=root).stdout.strip()
    return (head.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


def table(e: dict) -> str:
    lines = ["| round | completed | failed | output tok/s | median TTFT ms | median TPOT ms | load avg |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(e["rounds"], 1):
        lines.append(f"| {i} | {r['completed']}/{e['num_prompts']} | {r['failed']} | {r['output_throughput']:.1f} | "
                     f"{r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.0f} | "
                     f"{r['load_before']:.1f} -> {r['load_after']:.1f} |")
    tps = [r["output_throughput"] for r in e["rounds"]]
    lines += ["", f"Output tokens/s: {median_range(tps, '.1f')} over {len(e['rounds'])} "
              f"rounds; every request answered: {'yes' if e['all_completed'] else 'NO'}."]
    return "\n".join(lines)


def write(entry: dict, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    path = results / "vllm_bench_serve.json"
    entries = json.loads(path.read_text()) if path.is_file() else []
    entries.append(entry)
    path.write_text(json.dumps(entries, indent=2) + "\n")
    md = ["# vLLM's serving benchmark against `async-rl serve`", "",
          "See benchmarks/vllm_bench_serve.py. Newest first. The point is the `completed` column; the rates are "
          "taken with the load average shown (a machine shared with other jobs reads them low) and compare "
          "nothing: benchmarks/engine_throughput.py --backend vllm puts both servers side by side.", ""]
    for e in reversed(entries):
        md += [f"## {e['date']}, commit {e['commit']}", "", f"- command: `{e['command']}`",
               f"- CPU: {e['cpu']}, {e['cores']} cores", f"- server: `{e['server']}`", f"- client: `{e['client']}`",
               "", table(e), ""]
    (results / "vllm_bench_serve.md").write_text("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m | checkpoint dir (also the tokenizer)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="engine.num_threads of the server")
    ap.add_argument("--kv-cache-mb", type=float, default=512.0)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None, help="python of the vLLM environment (default: $ASYNC_RL_VLLM_"
                                                       "PYTHON, .venv-vllm/bin/python, /tmp/vllm-venv/bin/python)")
    ap.add_argument("--override", nargs="*", default=[], help="more dotted overrides for async-rl serve")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args()
    entry = measure(args)
    write(entry, Path(args.results))
    print(table(entry))
    if not entry["all_completed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
