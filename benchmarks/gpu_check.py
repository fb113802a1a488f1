"""The first run on a GPU machine, in one command: what runs on CUDA, what fails, and how fast.

    bash benchmarks/gpu_wheels.sh                        # here: the small wheels the GPU machine lacks
    python3 benchmarks/gpu_check.py --out DIR            # there, after installing them (see the script)

It never runs the CPU suite (where CUDA is visible, `auto` devices would move those e2e runs
onto the GPU); each step runs with a deadline and records ok / failed / skipped, its wall
time, its figures and the tail of its output:

1. the machine: GPU, torch, CUDA, bf16;
2. the `gpu`-marked tests (`pytest -m gpu`);
3. a debug run on CUDA per transport that fits one GPU (`disk`, `zmq`), then `async-rl audit`:
   reward first -> last steps, mean publish and load times;
4. FSDP2 on one rank over NCCL, with checkpoints;
5. what must be refused with one line before anything starts (`dist` with both sides on the
   one GPU), and what must run (`dist` from a CUDA trainer to a CPU engine: gloo);
6. speed on a random-weight Llama-shaped model of 0.79B parameters (hidden 2048, 16 layers,
   16 heads, 4 KV heads, vocab 32000, tied embeddings) with the project's small tokenizer: the engine benchmark
   (`benchmarks/engine_throughput.py --device cuda`) and training steps of the PPO trainer on a
   synthetic batch (trained tokens/s, step time, publish time, peak GPU memory);
7. where a decode step of the engine spends its time: 20 steps of 64 sequences on that model under
   torch.profiler (ops by device and by host time, kernels per step). The debug runs of 3. report
   the engine's own step times by batch size and the pause / load / continue phases of its updates.

Results: `gpu_check.json` and `gpu_check.md` in `--out` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, command, machine, synchronizer  # noqa: E402

DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")
QUIET = ["log.progress=false", "task.eval_size=16"]
DEADLINE = [float("inf")]  # time.monotonic() by which every step must be done (--budget)


def left(timeout: float) -> float:
    """A step's own limit, cut to what the whole check has left (a lease ends at a fixed time)."""
    return max(1.0, min(timeout, DEADLINE[0] - time.monotonic() - 10))


def sh(args: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """(exit code, last 4000 characters of stdout+stderr, seconds); 124 on timeout."""
    t0 = time.monotonic()
    timeout = left(timeout)
    try:
        p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
        code, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = 124, f"{exc.stdout or ''}{exc.stderr or ''}\n(timed out after {timeout:.0f}s)"
        out = out if isinstance(out, str) else out.decode(errors="replace")
    return code, out[-4000:], time.monotonic() - t0


def cli(*args: str, timeout: float = 600) -> tuple[int, str, float]:
    return sh([sys.executable, "-m", "async_rl.launch.cli", *args], timeout)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


def step(name: str, fn, results: list[dict], needs_s: float = 30) -> None:
    t0 = time.monotonic()
    if DEADLINE[0] - t0 < needs_s:
        results.append({"name": name, "status": "skipped", "seconds": 0,
                        "why": f"--budget: {max(0, DEADLINE[0] - t0):.0f}s left, the step needs ~{needs_s:.0f}s"})
        print(f"[skipped] {name} (out of time)", flush=True)
        return
    try:
        rec = fn()
    except Exception as exc:  # a check that breaks is a finding, not the end of the others
        rec = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    rec = {"name": name, "seconds": round(time.monotonic() - t0, 1), **rec}
    results.append(rec)
    print(f"[{rec['status']:>7}] {name} ({rec['seconds']}s)", flush=True)


def gpu_tests() -> dict:
    # only the files that hold gpu-marked tests: others import what the GPU machine lacks (ray, sglang)
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in f.read_text())
    code, out, _ = sh([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
                       "--continue-on-collection-errors", *files], timeout=240)
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    return {"status": "ok" if code == 0 else "failed", "summary": summary, "tail": out[-2500:]}


def pipeline(out: Path, transport: str, *extra: str, steps: int = 20) -> dict:
    run_dir = out / f"run_{transport}{'_' + extra[0].split('=')[0].split('.')[-1] if extra else ''}"
    code, tail, _ = cli("run", "--config", DEBUG, "engine.device=cuda", "trainer.device=cuda",
                        f"weight_sync.transport={transport}", f"total_steps={steps}", f"run_dir={run_dir}",
                        *QUIET, *extra)
    m, r = rows(run_dir / "metrics.jsonl"), rows(run_dir / "rollout_metrics.jsonl")
    audit_code, audit_out, _ = cli("audit", str(run_dir), timeout=120)
    k = max(1, min(3, len(m) // 3))
    rec = {"status": "ok" if code == 0 and audit_code == 0 and len(m) == steps else "failed", "exit": code,
           "steps": len(m), "audit": audit_out.strip().splitlines()[-2:] if audit_out.strip() else [],
           "reward_first": mean([x.get("train/reward_mean") for x in m[:k]]),
           "reward_last": mean([x.get("train/reward_mean") for x in m[-k:]]),
           "publish_s_mean": mean([x.get("timing/publish_s") for x in m]),
           "train_s_mean": mean([x.get("timing/train_s") for x in m]),
           "update_s_mean": mean([x.get("sync/update_s") for x in r]),
           **{f"{phase}_s_mean": mean([x.get(f"sync/server_{phase}_s_max") for x in r])
              for phase in ("pause", "load", "continue")},
           "engine_step_ms": step_ms(r[-1] if r else {})}
    if rec["status"] != "ok":
        rec["tail"] = tail[-2500:]
    return rec


def step_ms(row: dict) -> dict[str, float]:
    """Mean engine step time in ms by sequences sampled (the engine's own profile, `engine/step_t*_b*`)."""
    out = {}
    for key, n in row.items():
        m = re.fullmatch(r"engine/step_t\d+_b(\d+)_n", key)
        if m and n:
            out[f"b{m.group(1)}"] = round(1000 * row[key[:-2] + "_s"] / n, 2)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0][1:])))


def engine_profile(out: Path, shape: str = "1b", device: str = "cuda", requests: int = 64, steps: int = 20,
                   top: int = 15) -> dict:
    """Where one decode step of the embedded engine spends its time: `steps` steps of `requests` sequences
    under torch.profiler, after a warm-up; the ops that take the most device time and host time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from async_rl.config import EngineConfig, ModelConfig
    from async_rl.engine.llm_engine import LLMEngine
    from async_rl.models import load_model
    from async_rl.types import SamplingParams

    path = random_llama(out, shape, device)
    model = load_model(ModelConfig(name=str(path), dtype="bfloat16" if device.startswith("cuda") else "float32"),
                       device=device)
    engine = LLMEngine(model, EngineConfig(kv_cache_mb=1024, max_running=requests, max_tokens_per_step=4096))
    g = torch.Generator().manual_seed(0)
    for i in range(requests):
        prompt = torch.randint(3, SHAPES[shape]["vocab_size"], (64,), generator=g).tolist()
        engine.add_request(f"p{i}", prompt, SamplingParams(max_new_tokens=10 * steps, temperature=1.0,
                                                           ignore_eos=True))
    for _ in range(5):  # prefill and the first decodes: allocations, kernel choices
        engine.step()
    cuda = device.startswith("cuda")
    sync = synchronizer(device)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    ms = 1000 * (time.perf_counter() - t0) / steps
    table = prof.key_averages()
    lines = [f"{steps} decode steps of {requests} sequences: {ms:.2f} ms a step (under the profiler)", ""]
    if cuda:
        lines += ["by device time:",
                  table.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=48), ""]
    lines += ["by host time:", table.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48)]
    kernels = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    return {"status": "ok", "step_ms": round(ms, 2), "requests": requests,
            "kernels_per_step": round(kernels / steps, 1) if cuda else None, "table": "\n".join(lines)}


def refused(out: Path) -> dict:
    """`dist` with trainer and engine on the one GPU: one `error:` line, at once, nothing started."""
    code, tail, secs = cli("run", "--config", DEBUG, "engine.device=cuda", "trainer.device=cuda",
                           "weight_sync.transport=dist", "total_steps=2", f"run_dir={out / 'run_refused'}", *QUIET,
                           timeout=120)
    errors = [line for line in tail.splitlines() if line.startswith("error:")]
    ok = code != 0 and len(errors) == 1 and secs < 60 and "Traceback" not in tail
    return {"status": "ok" if ok else "failed", "exit": code, "seconds_to_refuse": round(secs, 1),
            "error": errors[0] if errors else tail[-1500:]}


# the 0.79B shape the check measures (tied embeddings), and a tiny one of the same family for the CPU smoke test
SHAPES = {"1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=32000),
          "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)}


def random_llama(out: Path, shape: str = "1b", device: str = "cuda") -> Path:
    """A random-weight Llama-shaped checkpoint with the project's small tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from async_rl.config import ModelConfig
    from async_rl.models import PRINTABLE, load_tokenizer

    path = out / f"llama_{shape}_random"
    if (path / "config.json").is_file():
        return path
    tok = load_tokenizer(ModelConfig(name="tiny", tiny_alphabet=PRINTABLE))
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def engine_speed(out: Path, results: Path) -> dict:
    model = random_llama(out)
    code, tail, _ = sh([sys.executable, "benchmarks/engine_throughput.py", "--model", str(model), "--dtype", "bfloat16",
                        "--device", "cuda", "--quick", "--kv-cache-mb", "4096", "--results", str(results)],
                       timeout=600, env={"TQDM_DISABLE": "1"})
    return {"status": "ok" if code == 0 else "failed", "table": tail[-3000:]}


def trainer_speed(out: Path, steps: int = 3, batch: int = 32, prompt: int = 256, response: int = 256,
                  shape: str = "1b", device: str = "cuda") -> dict:
    """PPO steps of the plain trainer on the random Llama (bf16 autocast, fp32 master weights), and
    one publish of its weights in bf16 to disk, as training publishes them."""
    import numpy as np
    import torch

    from async_rl.config import Config, ModelConfig, TrainerConfig
    from async_rl.models import load_model
    from async_rl.trainer.trainer import PPOTrainer
    from async_rl.types import Trajectory
    from async_rl.weight_sync.publishers import build_publisher

    path = random_llama(out, shape, device)
    cuda = device.startswith("cuda")
    sync = synchronizer(device)
    vocab = SHAPES[shape]["vocab_size"]
    model = load_model(ModelConfig(name=str(path), dtype="float32"), device=device).train()
    cfg = TrainerConfig(batch_size=batch, lr=1e-6, compute_dtype="bfloat16", micro_batch_tokens=8192)
    trainer = PPOTrainer(model, cfg, temperature=1.0, max_staleness=1, seed=0)
    rng = np.random.default_rng(0)

    def batch_of(version: int) -> list[list[Trajectory]]:
        groups = []
        for g in range(batch // 8):
            groups.append([Trajectory(
                id=f"t{version}-{g}-{i}", group_id=f"g{g}", prompt_ids=rng.integers(3, vocab, prompt, dtype=np.int32),
                response_ids=rng.integers(3, vocab, response, dtype=np.int32),
                loss_mask=np.ones(response, np.uint8), behav_logprobs=np.full(response, -10.0, np.float32),
                versions=np.full(response, version, np.int32), reward=float(i % 2), finish_reason="length")
                for i in range(8)])
        return groups

    trainer.train_step(batch_of(0))  # warm-up: allocator, kernels
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        stats = trainer.train_step(batch_of(trainer.policy_version))
        sync()
        times.append(time.perf_counter() - t0)
        if stats["train/optimizer_steps"] != 1:
            raise RuntimeError(f"a train step took no optimizer step: {stats}")
    tokens = batch * (prompt + response)
    run_cfg = Config()
    run_cfg.run_dir = str(out / "publish")
    run_cfg.model.dtype = "bfloat16"
    publisher = build_publisher(run_cfg, lambda msg: None)
    t0 = time.perf_counter()
    publisher.publish(trainer.weights(), trainer.policy_version)
    publish_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    times.sort()
    return {"status": "ok", "params_b": round(params / 1e9, 3), "batch": f"{batch} x ({prompt} + {response}) tokens",
            "step_s_median": round(times[len(times) // 2], 3), "step_s_min_max": [round(times[0], 3), round(times[-1], 3)],
            "tokens_per_s": round(tokens / times[len(times) // 2]),
            "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "publish_disk_bf16_s": round(publish_s, 2)}


def report(results: list[dict], info: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": info, "command": command(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "steps": results}
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# GPU check", "", f"`{doc['command']}` on {info.get('gpu', '?')}, torch {info.get('torch')}, "
             f"CUDA {info.get('cuda')}, {doc['date']}.", "", "| check | status | seconds | figures |", "|---|---|---|---|"]
    for r in results:
        figures = {k: v for k, v in r.items() if k not in ("name", "status", "seconds", "tail", "table")}
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']} | "
                     f"{re.sub(r'[|]', '/', json.dumps(figures))[:600]} |")
    for r in results:
        if r.get("tail") or r.get("table"):
            lines += ["", f"## {r['name']}", "", "```", (r.get("table") or r["tail"]).strip(), "```"]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS), help="where gpu_check.json / .md and the runs go")
    ap.add_argument("--work", default=None, help="where the runs and the random checkpoint go (default: OUT/gpu_check_runs)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds the whole check may take; steps are cut or skipped to end inside it")
    ap.add_argument("--skip", nargs="*", default=[], help="step names to skip: tests pipeline fsdp refusals speed profile")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("error: gpu_check needs a CUDA GPU (torch.cuda.is_available() is False); on a CPU machine run "
              "`make test`", file=sys.stderr)
        return 2
    if args.budget:
        DEADLINE[0] = time.monotonic() + args.budget
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "gpu_check_runs"
    work.mkdir(parents=True, exist_ok=True)
    info = {**machine(), "cuda": torch.version.cuda, "bf16": torch.cuda.is_bf16_supported(),
            "gpus": torch.cuda.device_count()}
    results: list[dict] = []
    plan = [("pipeline", "debug run on CUDA, disk", lambda: pipeline(work, "disk")),
            ("tests", "gpu-marked tests", gpu_tests),
            ("pipeline", "debug run on CUDA, zmq", lambda: pipeline(work, "zmq")),
            ("fsdp", "FSDP2 on one rank (NCCL), checkpoints", lambda: pipeline(
                work, "disk", "trainer.backend=fsdp", "trainer.world_size=1", "trainer.checkpoint_every=3", steps=8)),
            ("refusals", "dist with both sides on the one GPU is refused", lambda: refused(work)),
            ("refusals", "dist from a CUDA trainer to a CPU engine (gloo)", lambda: pipeline(
                work, "dist", "engine.device=cpu", steps=4)),
            ("speed", "PPO trainer steps on a random 0.79B Llama (bf16 autocast)", lambda: trainer_speed(work)),
            ("speed", "engine on a random 0.79B Llama (bf16)", lambda: engine_speed(work, out)),
            ("profile", "a decode step of the engine under torch.profiler (0.79B, 64 sequences)",
             lambda: engine_profile(work))]
    for key, name, fn in plan:
        if key in args.skip:
            results.append({"name": name, "status": "skipped", "seconds": 0, "why": "--skip"})
            continue
        step(name, fn, results, needs_s=90 if key in ("speed", "profile") else 30)
        report(results, info, out)  # after every step: a call cut short still leaves what ran
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
