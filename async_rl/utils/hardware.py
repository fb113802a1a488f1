"""Devices and dtypes that fit the machine: what `auto` means for `*.device` and `*.dtype`.

    device = resolve_device("auto")                 # cuda when present, else cpu
    choice = resolve_dtype("auto", device)          # DtypeChoice(dtype=torch.float32, reason="...")

bfloat16 is chosen only where the hardware runs it natively: a CUDA device that
supports it, or a CPU whose bf16 matrix multiply is measured to be faster than fp32.
CPUs come in kinds where bf16 is emulated (AVX2 only: a bf16 GEMM runs ~240x slower
than fp32), so the decision is never a guess: CPUs below AVX-512, or without the bf16
instructions (avx512_bf16, amx_bf16), get float32 without a probe; the others run a short
GEMM probe (a few ms) once per process and take bf16 only if it is measured faster.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DEVICE_CHOICES = "auto | cpu | cuda | cuda:N"
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
_PROBE_N = 256  # GEMM side of the probe: big enough to reach a kernel's speed, small enough to be quick
_BF16_MIN_SPEEDUP = 1.2  # bf16 must beat fp32 by this much to be worth its lower precision


class DeviceError(ValueError):
    """A configured device does not exist on this machine."""


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line a user reads: why this dtype on this device

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_device(spec: str, key: str = "device") -> torch.device:
    """`auto` -> cuda when present, else cpu; `cuda`/`cuda:N` checked against the devices here."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise DeviceError(f"{key}: {spec!r} is not a device ({DEVICE_CHOICES})") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceError(f"{key}: device type {device.type!r} is not supported ({DEVICE_CHOICES})")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise DeviceError(f"{key}: {spec!r} asked for, but this machine has no CUDA device; use cpu or auto")
    if device.index is not None and device.index >= count:
        raise DeviceError(f"{key}: {spec!r} asked for, but this machine has {count} CUDA device(s)")
    return device


def cpu_capability() -> str:
    """torch's view of the CPU's vector ISA: DEFAULT, AVX2, AVX512, ..."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # very old torch builds lack the query
        return "unknown"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=1)
def cpu_bf16_speedup(reps: int = 15) -> float:
    """Measured fp32-time / bf16-time of a small GEMM on this CPU with the current threads.

    The two dtypes are timed in alternation and the best of each is kept, so a busy
    machine (other processes stealing cores) disturbs both alike instead of one."""
    a32, b32 = torch.randn(_PROBE_N, _PROBE_N), torch.randn(_PROBE_N, _PROBE_N)
    a16, b16 = a32.to(torch.bfloat16), b32.to(torch.bfloat16)
    a32 @ b32, a16 @ b16  # warm-up: kernel selection, allocation
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    for _ in range(reps):
        for dtype, (a, b) in ((torch.float32, (a32, b32)), (torch.bfloat16, (a16, b16))):
            t0 = time.perf_counter()
            a @ b
            best[dtype] = min(best[dtype], time.perf_counter() - t0)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def resolve_dtype(spec: str, device: torch.device | str = "cpu") -> DtypeChoice:
    """The dtype to compute in: as configured, or for `auto` bf16 only where it is native."""
    device = torch.device(device)
    if spec != "auto":
        if spec not in DTYPE_CHOICES:
            raise ValueError(f"dtype: must be one of {'|'.join(DTYPE_CHOICES)}, got {spec!r}")
        return DtypeChoice(getattr(torch, spec), "set in the config")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, f"{torch.cuda.get_device_name(device)} runs bf16 natively")
        return DtypeChoice(torch.float32, f"{torch.cuda.get_device_name(device)} has no native bf16")
    cap = cpu_capability()
    if not cap.upper().startswith("AVX512"):
        return DtypeChoice(torch.float32, f"CPU capability {cap}: no native bf16 (emulated bf16 runs far slower than fp32)")
    flags = cpu_flags()
    if flags and not flags & {"avx512_bf16", "amx_bf16"}:
        return DtypeChoice(torch.float32, f"CPU capability {cap} without avx512_bf16/amx_bf16: bf16 is emulated")
    speedup = cpu_bf16_speedup()
    if speedup >= _BF16_MIN_SPEEDUP:
        return DtypeChoice(torch.bfloat16, f"CPU capability {cap}: bf16 GEMM measured {speedup:.1f}x fp32")
    return DtypeChoice(torch.float32, f"CPU capability {cap}: bf16 GEMM measured only {speedup:.2f}x fp32")
