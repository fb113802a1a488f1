"""What every benchmark records next to its table: the command that made it, the machine it ran on, the date."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """CPU kind (torch's capability: AVX2 / AVX512), cores, torch threads, bf16 probe, GPU if any."""
    import torch

    from async_rl.utils.hardware import cpu_bf16_speedup, cpu_capability

    info = {"cpu_capability": cpu_capability(), "cores": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "cpu_bf16_gemm_speedup": round(cpu_bf16_speedup(), 2),
            "processor": cpu_model(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_kind() -> str:
    """lscpu's model name and torch's CPU capability, with the bf16/AMX flags that decide the kernels."""
    import torch

    from async_rl.utils.hardware import cpu_flags

    extras = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in cpu_flags()]
    return f"{cpu_model()}, {torch.backends.cpu.get_cpu_capability()}" + (f" ({', '.join(extras)})" if extras else "")


def synchronizer(device) -> Callable[[], None]:
    """A call that waits for the work queued on `device` (CUDA runs asynchronously: a clock stopped
    before it reads launch time); a no-op on CPU."""
    import torch

    if str(device).startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def gemm_roof(shapes: list[tuple[int, int, int]], dtype: "torch.dtype | None" = None,
              trial_s: float = 0.25, trials: int = 3, device: str = "cpu") -> tuple[float, str]:
    """The best GEMM FLOP/s this process reaches (its torch threads, `dtype`, fp32 by default) over
    `shapes` (m, k, n), and the shape that gave it: the machine's roof a benchmark's FLOP/s is a share of.
    Each shape runs `trials` timed loops of ~`trial_s` seconds, sized by a warm-up of ~`trial_s` / 4,
    and its best loop counts. (Until 2026-11-28 one loop of >= 2 GFLOP was timed: a single
    512x2048x2048 product, ~20 ms, which on the 2-core Xeon read 159 GFLOP/s in one run against
    216-247 in loops of ten: a roof read low makes every share of it look high.)"""
    import torch

    dtype = dtype or torch.float32
    sync = synchronizer(device)
    best, name = 0.0, ""
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        calls, t0 = 0, time.perf_counter()
        while calls < 3 or time.perf_counter() - t0 < trial_s / 4:  # warm-up (a first call may pack or reorder)
            a @ b
            calls += 1
            sync()
        reps = max(3, int(trial_s * calls / (time.perf_counter() - t0)))
        rates = []
        for _ in range(trials):
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            sync()
            rates.append(2 * m * k * n * reps / (time.perf_counter() - t0))
        rate = max(rates)
        if rate > best:
            best, name = rate, f"{m}x{k}x{n}"
    return best, name


def drop_bulk(run_dir: Path) -> None:
    """Delete a finished benchmark run's checkpoints and weight versions (hundreds of MB a run; a sweep of
    dozens filled the disk): what the tables read (metrics, evaluations, logs, ledgers) stays."""
    import shutil

    for sub in ("checkpoints", "weights"):
        shutil.rmtree(Path(run_dir) / sub, ignore_errors=True)


def median_range(values: list[float], spec: str = ".3f") -> str:
    """A table cell: median (min-max) of the values, one value alone as itself, NaNs (not measured) left out."""
    import statistics

    vals = [v for v in values if v == v]
    if not vals:
        return "n/a"
    if len(vals) == 1:
        return format(vals[0], spec)
    return f"{format(statistics.median(vals), spec)} ({format(min(vals), spec)}-{format(max(vals), spec)})"


def command() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def write_results(name: str, markdown: str, data: dict) -> Path:
    """benchmarks/results/NAME.md (table, command, machine, date) and NAME.json; returns the .md path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    m = machine()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"Command: `{command()}`\n\nMachine: {m['processor']}, CPU capability {m['cpu_capability']}, "
              f"{m['cores']} cores, bf16 GEMM {m['cpu_bf16_gemm_speedup']}x fp32"
              + (f", GPU {m['gpu']}" if "gpu" in m else "") + f"\n\nDate: {date}\n\n")
    out = RESULTS / f"{name}.md"
    out.write_text(f"# {name}\n\n{header}{markdown}\n")
    (RESULTS / f"{name}.json").write_text(json.dumps({"command": command(), "machine": m, "date": date, **data},
                                                     indent=2))
    return out
