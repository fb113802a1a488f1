"""Building the engine's compiled CPU kernels: C source -> a shared library, once per source, flags and compiler.

    path = build_library(SOURCE, ["-O3", "-mavx2", ...], "cpu_kernels")   # RuntimeError naming what failed
    lib, why = load_library(SOURCE, FLAGS, "cpu_kernels", {"fn": [c_void_p, c_int]}, missing=None)
    lib = require(lib, why, "the compiled kernels")                          # RuntimeError naming why not
    KERNELS = KernelLibrary(SOURCE, FLAGS, "cpu_kernels", "the compiled kernels", signatures, missing)
    KERNELS.available(); KERNELS.lib()                                       # the same, loaded once

Built with the machine's C compiler (`$CC`, else `cc`: about a second) into `$ASYNC_RL_KERNEL_DIR` (default
~/.cache/async_rl/kernels), keyed by a hash of the source, flags and compiler, atomically (concurrent builders
race harmlessly). Used by `cpu_kernels` (fp32, AVX2) and `bf16_kernels` (bf16, AVX-512).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


def kernel_dir() -> Path:
    return Path(os.environ.get("ASYNC_RL_KERNEL_DIR") or Path.home() / ".cache" / "async_rl" / "kernels")


def build_library(source: str, flags: list[str], stem: str) -> Path:
    """The compiled library of `source`; RuntimeError naming what is missing or the compiler's last error line."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)")
    key = hashlib.sha256("\0".join([source, cc, *flags]).encode()).hexdigest()[:16]
    out = kernel_dir() / f"{stem}_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / f"{stem}.c", Path(tmp) / "lib.so"
        src.write_text(source)
        done = subprocess.run([cc, *flags, str(src), "-o", str(lib)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}")
        os.replace(lib, out)
    return out


def load_library(source: str, flags: list[str], stem: str, signatures: dict[str, list],
                 missing: str | None) -> tuple[ctypes.CDLL | None, str]:
    """(the library, its functions' argument types set and returning void, "") or (None, why not): `missing`
    (what the CPU lacks, if anything), a missing compiler or the compiler's error."""
    if missing:
        return None, missing
    try:
        lib = ctypes.CDLL(str(build_library(source, flags, stem)))
    except (RuntimeError, OSError) as exc:
        return None, str(exc)
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib, ""


def require(lib: ctypes.CDLL | None, why: str, what: str) -> ctypes.CDLL:
    if lib is None:
        raise RuntimeError(f"engine.cpu_kernels: {what} are not available: {why}")
    return lib


class KernelLibrary:
    """One compiled library, built and loaded at its first use (once): `available()` says whether it runs here
    and why not, `lib()` is the library or a RuntimeError naming why not. `signatures()` gives each function's
    argument types, `missing()` what the CPU lacks (None: nothing); `load.cache_clear()` loads it again."""

    def __init__(self, source: str, flags: list[str], stem: str, what: str,
                 signatures: Callable[[], dict[str, list]], missing: Callable[[], str | None]):
        self.source, self.flags, self.stem, self.what = source, flags, stem, what
        self._signatures, self._missing = signatures, missing
        self.load = functools.lru_cache(maxsize=None)(self._load)

    def _load(self) -> tuple[ctypes.CDLL | None, str]:
        return load_library(self.source, self.flags, self.stem, self._signatures(), self._missing())

    def available(self) -> tuple[bool, str]:
        lib, why = self.load()
        return lib is not None, why

    def lib(self) -> ctypes.CDLL:
        return require(*self.load(), self.what)
