"""A compiled fp32 GEMM for the engine's decode steps on AVX2 CPUs: y = x @ W^T (+ b) for x of few rows.

A decode step multiplies a few rows (one per decoding sequence) by every weight of the model, so it
streams the weights from memory once and does little arithmetic per byte. On a 2-core AMD EPYC
without AVX-512 oneDNN's pre-packed fp32 kernel read the weights at 10-20 GB/s there, against 30 GB/s
for a plain read of the same threads, and MKL's (`F.linear`) at 6-13 GB/s (it takes a generic path on
AMD CPUs). The kernel below reads each weight row where it lies (no packed copy), 4 rows at a time
against 3 rows of x (12 AVX2 accumulators, dot products along K), prefetching the
next rows while it computes, one OpenMP loop over the output columns on torch's own OpenMP runtime
(the library resolves `libgomp.so.1` to the one torch loaded). Over all linear layers of SmolLM2-135M
(0.54 GB of fp32 weights) it ran 1.3-1.5x faster than oneDNN's packed kernel at 1-32 rows, 1.1-1.2x at
64-128, and no faster from 256 rows (`python -m async_rl.engine.cpu_gemm` prints that table).

It is built at first use with the machine's C compiler (`$CC`, else `cc`: about a second) into
`$ASYNC_RL_KERNEL_DIR` (default ~/.cache/async_rl/kernels), keyed by a hash of its source and flags;
without a compiler, AVX2 or FMA the engine keeps torch's kernels (`available()` says why).
Which implementation the engine uses is `SMALL_GEMMS[engine.small_gemm]`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAX_ROWS = 128  # x of more rows (prefill chunks) runs oneDNN's kernel: from 256 rows the two were even

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

#define NB 4     /* weight rows (output columns) per tile */
#define MB 3     /* rows of x per tile: 12 accumulators, 4 weight vectors (of 4x3 and 3x4 tiles, the faster) */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[m0..m0+mb, n0..n0+nb) = x[m0.., :] . w[n0.., :] for K % 8 == 0; mb <= MB and nb <= NB are constants after
   inlining. The first tile of a column block prefetches the weights two blocks on (the tile that streams them
   from memory). Nothing else goes in here: a scalar K tail or a bias in this epilogue cost 10% at 64 rows. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *y, int m0,
        const int mb, int n0, const int nb, int N, int K, int first) {
    __m256 acc[MB][NB];
    for (int i = 0; i < mb; i++) for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    const float *wr = w + (int64_t)n0 * K, *xr = x + (int64_t)m0 * K;
    for (int k = 0; k < K; k += 8) {
        if (first && (k & 15) == 0)
            for (int j = 0; j < nb; j++) _mm_prefetch((const char *)(wr + (int64_t)(j + 2 * NB) * K + k), _MM_HINT_T0);
        __m256 wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = _mm256_loadu_ps(wr + (int64_t)j * K + k);
        for (int i = 0; i < mb; i++) {
            __m256 xv = _mm256_loadu_ps(xr + (int64_t)i * K + k);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++) for (int j = 0; j < nb; j++) y[(int64_t)(m0 + i) * N + n0 + j] = hsum(acc[i][j]);
}

#define ROWS(NBV) do { \
        int m0 = 0, first = 1; \
        for (; m0 + MB <= M; m0 += MB, first = 0) tile(x, w, y, m0, MB, n0, NBV, N, K, first); \
        if (M - m0 == 1) tile(x, w, y, m0, 1, n0, NBV, N, K, first); \
        else if (M - m0 == 2) tile(x, w, y, m0, 2, n0, NBV, N, K, first); \
    } while (0)

/* y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), fp32, contiguous, row-major, K % 8 == 0. */
void sgemm_xwt(const float *x, const float *w, const float *bias, float *y, int M, int N, int K, int threads) {
    const int full = N / NB * NB;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int n0 = 0; n0 < full; n0 += NB) ROWS(NB);
        #pragma omp single
        for (int n0 = full; n0 < N; n0++) ROWS(1);
        if (bias) {
            #pragma omp for schedule(static)
            for (int m = 0; m < M; m++) for (int n = 0; n < N; n++) y[(int64_t)m * N + n] += bias[n];
        }
    }
}
"""
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def _cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _kernel_dir() -> Path:
    return Path(os.environ.get("ASYNC_RL_KERNEL_DIR") or Path.home() / ".cache" / "async_rl" / "kernels")


def _build() -> Path:
    """The compiled library, built once per source, flags and compiler (atomically: concurrent builders race
    harmlessly). Raises RuntimeError naming what is missing."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)")
    key = hashlib.sha256("\0".join([SOURCE, cc, *FLAGS]).encode()).hexdigest()[:16]
    out = _kernel_dir() / f"sgemm_xwt_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / "sgemm_xwt.c", Path(tmp) / "lib.so"
        src.write_text(SOURCE)
        done = subprocess.run([cc, *FLAGS, str(src), "-o", str(lib)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}")
        os.replace(lib, out)
    return out


@functools.lru_cache(maxsize=None)
def _load() -> tuple[object | None, str]:
    """(the kernel, "") or (None, why not)."""
    if not _cpu_has_avx2():
        return None, f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    try:
        fn = ctypes.CDLL(str(_build())).sgemm_xwt
    except (RuntimeError, OSError) as exc:
        return None, str(exc)
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    fn.restype = None
    return fn, ""


def available() -> tuple[bool, str]:
    """Whether the compiled kernel runs here, and if not, why."""
    fn, why = _load()
    return fn is not None, why


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias, fp32 CPU tensors, through the compiled kernel (`available()` first)."""
    fn, why = _load()
    if fn is None:
        raise RuntimeError(f"engine.small_gemm: the compiled kernel is not available: {why}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 \
            or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"cpu_gemm.linear: fp32 CPU x [M, K] and weight [N, K] expected, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    if x.shape[1] % 8:  # the kernel takes K in steps of 8 (every hidden size of these models is a multiple of 64)
        return torch.nn.functional.linear(x, weight, bias)
    x, weight = x.contiguous(), weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = x.new_empty(x.shape[0], weight.shape[0])
    fn(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
       x.shape[0], weight.shape[0], x.shape[1], torch.get_num_threads())
    return y


def _torch(device: torch.device, dtype: torch.dtype):
    return None


def _compiled(device: torch.device, dtype: torch.dtype):
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"engine.small_gemm: 'compiled' runs fp32 on a CPU; this engine runs {dtype} on {device}")
    ok, why = available()
    if not ok:
        raise ValueError(f"engine.small_gemm: 'compiled' cannot run here: {why}; use auto or torch")
    return linear


def _auto(device: torch.device, dtype: torch.dtype):
    """The compiled kernel where it was measured faster (fp32 on an AVX2 CPU without AVX-512), else torch's."""
    if device.type != "cpu" or dtype != torch.float32 or torch.backends.cpu.get_cpu_capability() != "AVX2":
        return None
    ok, why = available()
    if not ok:
        logger.info("engine: decode GEMMs run torch's kernels (the compiled one: %s)", why)
        return None
    return linear


# engine.small_gemm -> (device, dtype) -> the GEMM for steps of <= MAX_ROWS rows, or None for torch's kernels
SMALL_GEMMS = {"auto": _auto, "compiled": _compiled, "torch": _torch}


def small_gemm(name: str, device: torch.device, dtype: torch.dtype):
    if name not in SMALL_GEMMS:
        raise ValueError(f"engine.small_gemm: unknown {name!r}; registered: {', '.join(sorted(SMALL_GEMMS))}")
    return SMALL_GEMMS[name](device, dtype)


def _bench() -> None:  # python -m async_rl.engine.cpu_gemm: the table quoted in the module docstring
    import time

    torch.manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # SmolLM2-135M
    weights = [torch.randn(n, k) for n, k in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    print(f"{torch.get_num_threads()} threads, {sum(w.numel() for w in weights) * 4 / 1e9:.2f} GB of weights; "
          "ms per pass over every layer, best of 5")
    print("| rows | oneDNN packed | compiled | speed-up |\n|---|---|---|---|")
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        best = {}
        for name in ("packed", "compiled"):
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for w, p in zip(weights, packed):
                    x = xs[w.shape[1]]
                    if name == "packed":
                        torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                    else:
                        linear(x, w)
                times.append(time.perf_counter() - t0)
            best[name] = min(times) * 1e3
        print(f"| {rows} | {best['packed']:.1f} | {best['compiled']:.1f} | {best['packed'] / best['compiled']:.2f}x |")


if __name__ == "__main__":
    _bench()
