"""Compiled fp32 kernels for the engine's decode steps on AVX2 CPUs: the small GEMM and the slab's attention.

- **GEMM** y = x @ W^T (+ b) for x of few rows. A decode step multiplies a few rows (one per decoding
  sequence) by every weight of the model, so it streams the weights from memory once and does little
  arithmetic per byte. On a 2-core AMD EPYC without AVX-512 oneDNN's pre-packed fp32 kernel read the
  weights at 10-20 GB/s, against 30 GB/s for a plain read of the same threads, and MKL's (`F.linear`) at
  6-13 GB/s (it takes a generic path on AMD CPUs). The kernel reads each weight row where it lies (no
  packed copy), 4 rows at a time against 3 rows of x (12 AVX2 accumulators, dot products along K),
  prefetching the weights two tiles on, one OpenMP loop over the output columns. Over all linear layers
  of SmolLM2-135M (0.54 GB of fp32 weights) it ran 1.11-1.39x faster than oneDNN's packed kernel at 1-128
  rows and 0.95-0.99x at 256 (two runs of `python -m async_rl.engine.cpu_kernels`, which prints that
  table): steps of more than
  `MAX_ROWS` rows (prefill chunks) keep oneDNN's.
- **Slab attention** (async_rl/engine/decode_slab.py): for each row and KV head, the step's new key and
  value go into the row, then its query heads attend over the row's own length, not the tier's width (the
  padding, up to half a row, is not read), scores and softmax (exp by a degree-5 polynomial, within ~1e-7)
  in registers and one scratch row, one OpenMP loop over rows x KV heads. On the same CPU, 64 rows of a
  256-wide tier over 30 layers: 28-31 ms against 54-66 ms (3 passes of one run) for torch's batched
  matmuls (which also need the K/V written by an index_put first); outputs within 1e-6 of them.

Both run on torch's own OpenMP runtime (the library's `libgomp.so.1` resolves to the one torch loaded) with
torch's thread count, one thread for small work (`PARALLEL_MIN_*`). They are built at first use with the machine's
C compiler (async_rl/engine/kernel_build.py); without a compiler, AVX2 or FMA the engine keeps torch's kernels
(`available()` says why). Which the engine uses is `CPU_KERNELS[engine.cpu_kernels]`: these for fp32, the bf16
kernels of async_rl/engine/bf16_kernels.py (AVX-512) for bf16.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from async_rl.engine import bf16_kernels
from async_rl.engine.kernel_build import KernelLibrary

logger = logging.getLogger(__name__)

MAX_ROWS = 128  # x of more rows (prefill chunks) runs oneDNN's kernel: from 256 rows the two were even
# Work under these sizes runs on one thread, as torch's own kernels do below their grain: a parallel region
# costs a wake-up and a barrier, and where processes share the cores (two test workers, trainer and engine on
# one machine) a barrier waits for a time slice: the engine tests of a tiny model ran 113 s instead of 17 s
# under `pytest -n 2` with every call on two threads
PARALLEL_MIN_WEIGHT = 1 << 18  # GEMM: elements of the weight (1 MB in fp32)
PARALLEL_MIN_KV = 1 << 16  # attention: elements of K read (rows x KV heads x width x head dim)

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
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

/* exp(x) for x <= 0 (softmax after the max is taken off): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-5
   minimax polynomial (Cephes' coefficients), 2^n put into the exponent; under -87 it returns ~1e-38, not 0. */
static inline __m256 exp_nonpos(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* Decode attention over a slab tier's rows (async_rl/engine/decode_slab.py), one layer: for row b and KV head h,
   the step's new key and value go in at position lens[b] - 1 (kt [B, KVH, D, W] holds K transposed, vt
   [B, KVH, W, D]), then the G query heads of h attend over the row's first lens[b] keys only (the padding of
   the tier is not read). q, kn, vn: [B, *, D] rows of strides qs, ks, vs (floats), heads contiguous; out
   [B, KVH * G, D] contiguous; scratch [B * KVH, G, W]. W % 32 == 0, D % 8 == 0. */
void slab_attention(const float *q, int64_t qs, const float *kn, int64_t ks, const float *vn, int64_t vs,
                    float *kt, float *vt, const int *lens, float *out, float *scratch,
                    int B, int KVH, int G, int D, int W, float scale, int threads) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int item = 0; item < B * KVH; item++) {
        const int b = item / KVH, h = item % KVH, L = lens[b], L8 = (L + 7) & ~7;
        float *ktb = kt + (int64_t)item * D * W, *vb = vt + (int64_t)item * W * D;
        const float *kr = kn + b * ks + h * D, *vr = vn + b * vs + h * D;
        for (int d = 0; d < D; d++) ktb[(int64_t)d * W + L - 1] = kr[d];
        for (int d = 0; d < D; d++) vb[(int64_t)(L - 1) * D + d] = vr[d];
        const float *qb = q + b * qs + (int64_t)h * G * D;
        float *sc = scratch + (int64_t)item * G * W;
        for (int t0 = 0; t0 < L; t0 += 32)  /* scores: a [D, 32] block of K, from L1 for every query head */
            for (int g = 0; g < G; g++) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                const float *kp = ktb + t0;
                for (int d = 0; d < D; d++, kp += W) {
                    __m256 qv = _mm256_set1_ps(qb[g * D + d] * scale);
                    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp), a0);
                    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp + 8), a1);
                    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp + 16), a2);
                    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp + 24), a3);
                }
                float *sp = sc + g * W + t0;
                _mm256_storeu_ps(sp, a0); _mm256_storeu_ps(sp + 8, a1);
                _mm256_storeu_ps(sp + 16, a2); _mm256_storeu_ps(sp + 24, a3);
            }
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        for (int g = 0; g < G; g++) {
            float *sg = sc + g * W;
            for (int t = L; t < L8; t++) sg[t] = -INFINITY;
            __m256 mv = ninf;
            for (int t = 0; t < L8; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + t));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(m4));
            __m256 sum = _mm256_setzero_ps();
            for (int t = 0; t < L8; t += 8) {
                __m256 sv = _mm256_loadu_ps(sg + t);
                __m256 e = _mm256_and_ps(exp_nonpos(_mm256_sub_ps(sv, m)), _mm256_cmp_ps(sv, ninf, _CMP_NEQ_OQ));
                _mm256_storeu_ps(sg + t, e);
                sum = _mm256_add_ps(sum, e);
            }
            const float inv = 1.0f / hsum(sum);
            float *o = out + ((int64_t)item * G + g) * D;
            int dc = 0;
            for (; dc + 64 <= D; dc += 64) {  /* probabilities x V, 8 vectors of the head at a time */
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (int t = 0; t < L; t++) {
                    const __m256 p = _mm256_set1_ps(sg[t]);
                    const float *vp = vb + (int64_t)t * D + dc;
                    for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vp + 8 * j), acc[j]);
                }
                for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + dc + 8 * j, _mm256_mul_ps(acc[j], _mm256_set1_ps(inv)));
            }
            for (; dc < D; dc += 8) {
                __m256 acc = _mm256_setzero_ps();
                for (int t = 0; t < L; t++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(sg[t]), _mm256_loadu_ps(vb + (int64_t)t * D + dc), acc);
                _mm256_storeu_ps(o + dc, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
            }
        }
    }
}
"""
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def _cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _signatures() -> dict[str, list]:
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return {"sgemm_xwt": [ptr] * 4 + [i32] * 4,
            "slab_attention": [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr] + [i32] * 5
            + [ctypes.c_float, i32]}


def _missing() -> str | None:
    return None if _cpu_has_avx2() else f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"


KERNELS = KernelLibrary(SOURCE, FLAGS, "cpu_kernels", "the compiled kernels", _signatures, _missing)
_load, _lib = KERNELS.load, KERNELS.lib
available = KERNELS.available  # whether the compiled kernels run here, and if not, why


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias, fp32 CPU tensors, through the compiled GEMM (`available()` first)."""
    lib = _lib()
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 \
            or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"cpu_kernels.linear: fp32 CPU x [M, K] and weight [N, K] expected, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    if x.shape[1] % 8:  # the kernel takes K in steps of 8 (every hidden size of these models is a multiple of 64)
        return torch.nn.functional.linear(x, weight, bias)
    x, weight = x.contiguous(), weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = x.new_empty(x.shape[0], weight.shape[0])
    lib.sgemm_xwt(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                  x.shape[0], weight.shape[0], x.shape[1],
                  torch.get_num_threads() if weight.numel() >= PARALLEL_MIN_WEIGHT else 1)
    return y


def slab_attention_fits(width: int, head_dim: int, group: int, dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and width % 32 == 0 and head_dim % 8 == 0


def slab_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
                   lens: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, scale: float) -> None:
    """One layer of decode attention over a slab tier's rows 0..B-1, in place: the step's new keys and values
    k, v [B, kvH, D] go into kt [B, kvH, D, W] and vt [B, kvH, W, D] at position lens - 1, then the query heads
    q [B, kvH * G, D] attend over each row's first lens[b] keys into out [B, kvH * G, D]. lens int32 [B];
    scratch fp32 with room for [B * kvH, G, W]. q, k, v may be row views of a wider tensor (heads contiguous)."""
    lib = _lib()
    b, heads, d = q.shape
    kvh, w = kt.shape[1], kt.shape[3]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != d or t.dtype != torch.float32:
            raise ValueError(f"cpu_kernels.slab_attention: {name} must be fp32 rows of contiguous heads, got "
                             f"strides {t.stride()} {t.dtype}")
    if not (kt.is_contiguous() and vt.is_contiguous() and out.is_contiguous() and lens.dtype == torch.int32
            and lens.is_contiguous() and slab_attention_fits(w, d, heads // kvh, kt.dtype)
            and scratch.numel() >= b * heads * w):
        raise ValueError("cpu_kernels.slab_attention: kt, vt, out, lens (int32) contiguous, W % 32 == 0, "
                         f"D % 8 == 0 and scratch of {b * heads * w} floats expected")
    lib.slab_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                       kt.data_ptr(), vt.data_ptr(), lens.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                       b, kvh, heads // kvh, d, w, scale,
                       torch.get_num_threads() if b * kvh * w * d >= PARALLEL_MIN_KV else 1)


@dataclass(frozen=True)
class Kernels:
    """What the engine runs through compiled code; a piece left None runs torch's ops."""

    linear: Callable | None = None  # x @ W^T (+ b) for steps of <= MAX_ROWS rows
    slab_attention: Callable | None = None  # one layer of decode attention over a slab tier, the step's K/V written in
    attention_fits: Callable[[int, int, int, torch.dtype], bool] = lambda width, head_dim, group, dtype: False
    add_rms_norm: Callable | None = None  # residual add + RMS norm
    rotary: Callable | None = None  # q/k rotation in place
    silu_mul: Callable | None = None  # silu(gate) * up
    sample: Callable | None = None  # a token per row of plain sampling (async_rl/engine/sampler.py)


COMPILED = Kernels(linear=linear, slab_attention=slab_attention, attention_fits=slab_attention_fits)
BF16 = Kernels(slab_attention=bf16_kernels.slab_attention, attention_fits=bf16_kernels.slab_attention_fits,
               add_rms_norm=bf16_kernels.add_rms_norm, rotary=bf16_kernels.rotary, silu_mul=bf16_kernels.silu_mul,
               sample=bf16_kernels.sample)
# dtype -> (its compiled kernels, whether they can run here and why not)
BY_DTYPE: dict[torch.dtype, tuple[Kernels, Callable[[], tuple[bool, str]]]] = {
    torch.float32: (COMPILED, lambda: available()), torch.bfloat16: (BF16, lambda: bf16_kernels.available())}


def _torch(device: torch.device, dtype: torch.dtype) -> Kernels | None:
    return None


def _compiled(device: torch.device, dtype: torch.dtype) -> Kernels | None:
    if device.type != "cpu" or dtype not in BY_DTYPE:
        raise ValueError(f"engine.cpu_kernels: 'compiled' runs fp32 or bf16 on a CPU; this engine runs {dtype} on "
                         f"{device}")
    kernels, check = BY_DTYPE[dtype]
    ok, why = check()
    if not ok:
        raise ValueError(f"engine.cpu_kernels: 'compiled' cannot run here: {why}; use auto or torch")
    return kernels


def _auto(device: torch.device, dtype: torch.dtype) -> Kernels | None:
    """The compiled kernels where they were measured faster: fp32 on an AVX2 CPU without AVX-512 (the GEMM and
    attention of this module), bf16 on an AVX-512 CPU (async_rl/engine/bf16_kernels.py); else torch's."""
    capability = torch.backends.cpu.get_cpu_capability()
    if device.type != "cpu" or (dtype, capability) not in ((torch.float32, "AVX2"), (torch.bfloat16, "AVX512")):
        return None
    kernels, check = BY_DTYPE[dtype]
    ok, why = check()
    if not ok:
        logger.info("engine: decode steps run torch's kernels (the compiled ones: %s)", why)
        return None
    return kernels


# engine.cpu_kernels -> (device, dtype) -> the compiled kernels, or None for torch's
CPU_KERNELS: dict[str, Callable[[torch.device, torch.dtype], Kernels | None]] = {
    "auto": _auto, "compiled": _compiled, "torch": _torch}


def cpu_kernels(name: str, device: torch.device, dtype: torch.dtype) -> Kernels | None:
    if name not in CPU_KERNELS:
        raise ValueError(f"engine.cpu_kernels: unknown {name!r}; registered: {', '.join(sorted(CPU_KERNELS))}")
    return CPU_KERNELS[name](device, dtype)


def _bench() -> None:  # python -m async_rl.engine.cpu_kernels: the table quoted in the module docstring
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
