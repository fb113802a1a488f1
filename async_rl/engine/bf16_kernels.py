"""Compiled bf16 kernels for the engine on AVX-512 CPUs: a step's element-wise work and decode attention.

In bf16 a decode step of a small model is many small operations: per layer two RMS norms (eight torch
ops each, through fp32), the rotary embedding (four), SiLU x up (two), the residual adds, the K/V
writes and the slab's attention (four batched ops over the tier's padded width). Each torch op is a
parallel region: a wake-up and a barrier of the threads. On a 2-core machine whose cores are shared
(other processes, or the trainer beside the engine) a barrier waits for a descheduled thread's time
slice, so the step's cost grows with its number of regions more than with its arithmetic. These
kernels do each of those pieces in one region, reading and writing bf16 and computing in fp32:

- `add_rms_norm`: the residual add (rounded to bf16, as `x.add_` rounds) and the RMS norm of the sum,
  `weight * bf16(x / rms(x))`, as Llama's RMSNorm computes it;
- `rotary`: q and k heads rotated in place at each token's position, from the cos/sin tables, and the
  token's key and value written into the paged KV pool at its slot;
- `silu_mul`: `silu(gate) * up` from the gate/up GEMM's output;
- `slab_attention`: the step's new K/V written into the slab rows (async_rl/engine/decode_slab.py),
  then each row's query heads attend over the row's own length (the tier's padding is not read),
  scores, softmax (exp by a degree-5 polynomial, within ~1e-7) and the weighted sum in fp32.

Where torch rounds each intermediate to bf16 (x*cos, roll(x)*sin, their sum; silu, then the product;
the bf16 scores of a batched matmul) these round once, so results differ from torch's path by about
one bf16 unit in the last place and sit closer to the fp32 result; the engine's log-probs stay within
the bf16 tolerance of a fresh Hugging Face forward (tests/unit/test_bf16_kernels.py).

They need AVX-512 (F, BW, VL; bf16 is converted by shifts, so `avx512_bf16` is not required) and a C
compiler; built at first use like `cpu_kernels` (same directory, keyed by source and flags). Which the
engine uses is `engine.cpu_kernels` (`auto`: these for bf16 on an AVX-512 CPU where they build).
"""

from __future__ import annotations

import ctypes

import torch

from async_rl.engine.kernel_build import KernelLibrary
from async_rl.utils.hardware import cpu_flags

# Work under these sizes runs on one thread (a parallel region costs more than it saves)
# element-wise kernels: elements read. A decode step's (64 rows: 37K elements a norm, 197K for SiLU x up) run on one
# thread: tens of microseconds, where a parallel region on cores shared with other processes waits for a time slice
PARALLEL_MIN_ELEMENTS = 1 << 18
PARALLEL_MIN_KV = 1 << 16  # attention: elements of K read (rows x KV heads x width x head dim)

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

typedef uint16_t bf16;

static inline __m512 ld(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 ldm(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
/* fp32 -> bf16 rounded to nearest even, NaN kept a NaN: torch's c10::BFloat16 rounding */
static inline __m256i cvt(__m512 v) {
    __m512i i = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(i, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}
static inline void st(bf16 *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, cvt(v)); }
static inline void stm(bf16 *p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, cvt(v)); }
static inline __mmask16 tail(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
static inline float rnd(float x) {  /* one value rounded to bf16 and back */
    uint32_t u; __builtin_memcpy(&u, &x, 4);
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
    __builtin_memcpy(&x, &u, 4);
    return x;
}

/* exp(x) for x <= 0: x = n ln2 + r, exp(r) by its degree-5 minimax polynomial (Cephes), 2^n into the exponent */
static inline __m512 exp_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* x [M, H] (rows xs apart) += delta [M, H] (rows ds apart; skipped when NULL), rounded to bf16; then
   out [M, H] (contiguous) = w * bf16(x * rsqrt(mean(x^2) + eps)). */
void add_rms_norm(bf16 *x, int64_t xs, const bf16 *delta, int64_t ds, const bf16 *w, bf16 *out,
                  int M, int H, float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int m = 0; m < M; m++) {
        bf16 *xr = x + (int64_t)m * xs;
        bf16 *o = out + (int64_t)m * H;
        __m512 ss = _mm512_setzero_ps();
        for (int c = 0; c < H; c += 16) {
            __mmask16 k = tail(H - c);
            __m512 v = ldm(xr + c, k);
            if (delta) {
                v = _mm512_add_ps(v, ldm(delta + (int64_t)m * ds + c, k));
                __m256i r = cvt(v);
                _mm256_mask_storeu_epi16(xr + c, k, r);
                v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / H + eps));
        for (int c = 0; c < H; c += 16) {
            __mmask16 k = tail(H - c);
            __m512 n = _mm512_mul_ps(ldm(xr + c, k), inv);
            n = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt(n)), 16));
            stm(o + c, _mm512_mul_ps(ldm(w + c, k), n), k);
        }
    }
}

/* Rotary embedding in place: NH heads of D (even) at x + n * xs for token n, rotated at position pos[n]:
   x * cos + roll(x, D/2) * sin, with cos/sin tables [C, D] whose sin carries rotate_half's sign. With pools
   (kpool, vpool: rows of KVH * D per slot), the token's last KVH rotated heads (its key) and the KVH heads after
   them (its value) are then copied to row slots[n] of each. */
void rotary(bf16 *x, int64_t xs, int NH, int D, const bf16 *cos, const bf16 *sin, const int64_t *pos, int N,
            const int64_t *slots, bf16 *kpool, bf16 *vpool, int KVH, int threads) {
    const int half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const bf16 *cr = cos + pos[n] * D, *sr = sin + pos[n] * D;
        for (int h = 0; h < NH; h++) {
            bf16 *a = x + (int64_t)n * xs + (int64_t)h * D, *b = a + half;
            for (int c = 0; c < half; c += 16) {
                const __mmask16 k = tail(half - c);
                __m512 xa = ldm(a + c, k), xb = ldm(b + c, k);
                __m512 ya = _mm512_fmadd_ps(xb, ldm(sr + c, k), _mm512_mul_ps(xa, ldm(cr + c, k)));
                __m512 yb = _mm512_fmadd_ps(xa, ldm(sr + half + c, k), _mm512_mul_ps(xb, ldm(cr + half + c, k)));
                stm(a + c, ya, k);
                stm(b + c, yb, k);
            }
        }
        if (kpool) {
            const bf16 *key = x + (int64_t)n * xs + (int64_t)(NH - KVH) * D;
            __builtin_memcpy(kpool + slots[n] * KVH * D, key, (size_t)KVH * D * sizeof(bf16));
            __builtin_memcpy(vpool + slots[n] * KVH * D, key + (int64_t)KVH * D, (size_t)KVH * D * sizeof(bf16));
        }
    }
}

/* out [M, I] (contiguous) = silu(gu[:, :I]) * gu[:, I:] for gu rows gs apart */
void silu_mul(const bf16 *gu, int64_t gs, bf16 *out, int M, int I, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int m = 0; m < M; m++) {
        const bf16 *g = gu + (int64_t)m * gs, *u = g + I;
        bf16 *o = out + (int64_t)m * I;
        for (int c = 0; c < I; c += 16) {
            __mmask16 k = tail(I - c);
            __m512 x = ldm(g + c, k);
            __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  /* exp(-|x|) */
            __m512 one = _mm512_set1_ps(1.0f);
            __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ),
                                                            e, one), _mm512_add_ps(one, e));
            stm(o + c, _mm512_mul_ps(_mm512_mul_ps(x, sig), ldm(u + c, k)), k);
        }
    }
}

/* Decode attention over a slab tier's rows, one layer (the fp32 kernel of cpu_kernels.py, in bf16): for row b and
   KV head h the step's new key and value go in at position lens[b] - 1 (kt [B, KVH, D, W] holds K transposed, vt
   [B, KVH, W, D]), then the G query heads of h attend over the row's first lens[b] keys. q, kn, vn: [B, *, D] rows
   of strides qs, ks, vs (elements), heads contiguous; out [B, KVH * G, D] contiguous; scratch fp32 [B * KVH, G, W].
   W % 32 == 0, D % 16 == 0, D <= 256, G <= 16. */
void slab_attention(const bf16 *q, int64_t qs, const bf16 *kn, int64_t ks, const bf16 *vn, int64_t vs,
                    bf16 *kt, bf16 *vt, const int *lens, bf16 *out, float *scratch,
                    int B, int KVH, int G, int D, int W, float scale, int threads) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int item = 0; item < B * KVH; item++) {
        const int b = item / KVH, h = item % KVH, L = lens[b], L16 = (L + 15) & ~15;
        bf16 *ktb = kt + (int64_t)item * D * W, *vb = vt + (int64_t)item * W * D;
        const bf16 *kr = kn + b * ks + h * D, *vr = vn + b * vs + h * D;
        for (int d = 0; d < D; d++) ktb[(int64_t)d * W + L - 1] = kr[d];
        for (int d = 0; d < D; d++) vb[(int64_t)(L - 1) * D + d] = vr[d];
        float qf[16 * 256];
        const bf16 *qb = q + b * qs + (int64_t)h * G * D;
        for (int g = 0; g < G; g++)
            for (int c = 0; c < D; c += 16)
                _mm512_storeu_ps(qf + g * D + c, _mm512_mul_ps(ld(qb + g * D + c), _mm512_set1_ps(scale)));
        float *sc = scratch + (int64_t)item * G * W;
        for (int t0 = 0; t0 < L; t0 += 32)  /* scores: a [D, 32] block of K, from L1 for every query head */
            for (int g = 0; g < G; g++) {
                __m512 a0 = _mm512_setzero_ps(), a1 = a0;
                const bf16 *kp = ktb + t0;
                const float *qg = qf + g * D;
                for (int d = 0; d < D; d++, kp += W) {
                    __m512 qv = _mm512_set1_ps(qg[d]);
                    a0 = _mm512_fmadd_ps(qv, ld(kp), a0);
                    a1 = _mm512_fmadd_ps(qv, ld(kp + 16), a1);
                }
                _mm512_storeu_ps(sc + g * W + t0, a0);
                _mm512_storeu_ps(sc + g * W + t0 + 16, a1);
            }
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        for (int g = 0; g < G; g++) {
            float *sg = sc + g * W;
            for (int t = L; t < L16; t++) sg[t] = -INFINITY;
            __m512 mv = ninf;
            for (int t = 0; t < L16; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + t));
            const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
            __m512 sum = _mm512_setzero_ps();
            for (int t = 0; t < L16; t += 16) {
                __m512 sv = _mm512_loadu_ps(sg + t);
                __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sv, ninf, _CMP_NEQ_OQ), exp_nonpos(_mm512_sub_ps(sv, mx)));
                _mm512_storeu_ps(sg + t, e);
                sum = _mm512_add_ps(sum, e);
            }
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
            bf16 *o = out + ((int64_t)item * G + g) * D;
            for (int dc = 0; dc < D; dc += 64) {  /* probabilities x V, 4 vectors of the head at a time */
                const int nj = D - dc >= 64 ? 4 : (D - dc) / 16;
                __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int t = 0; t < L; t++) {
                    const __m512 p = _mm512_set1_ps(sg[t]);
                    const bf16 *vp = vb + (int64_t)t * D + dc;
                    for (int j = 0; j < nj; j++) acc[j] = _mm512_fmadd_ps(p, ld(vp + 16 * j), acc[j]);
                }
                for (int j = 0; j < nj; j++) st(o + dc + 16 * j, _mm512_mul_ps(acc[j], inv));
            }
        }
    }
}

/* One token per row of logits [S, V] (rows ls apart, fp32): greedy (inv_t[r] == 0: the first maximum) or drawn
   from softmax(logits * inv_t[r]) by the inverse CDF at u[r] * (sum of the weights), u[r] in [0, 1). Also the
   row's log-normaliser lse[r] (of logits * inv_t, or of the logits for a greedy row) and the token's log-prob. */
void sample_rows(const float *logits, int64_t ls, const float *inv_t, const float *u, int64_t *tokens,
                 float *logprobs, float *lse, int S, int V, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < S; r++) {
        const float *x = logits + (int64_t)r * ls;
        const float sc = inv_t[r] > 0.0f ? inv_t[r] : 1.0f;
        const __m512 scv = _mm512_set1_ps(sc);
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < V; c += 16) mv = _mm512_max_ps(mv, _mm512_maskz_loadu_ps(tail(V - c), x + c));
        const float top = _mm512_reduce_max_ps(mv);
        int arg = -1;
        for (int c = 0; c < V && arg < 0; c += 16) {  /* the first maximum */
            const __mmask16 k = tail(V - c);
            const __mmask16 hit = _mm512_mask_cmp_ps_mask(k, _mm512_maskz_loadu_ps(k, x + c), _mm512_set1_ps(top),
                                                          _CMP_EQ_OQ);
            if (hit) arg = c + __builtin_ctz(hit);
        }
        if (arg < 0) arg = 0;  /* a row of NaN */
        const float m = top * sc;
        const __m512 mm = _mm512_set1_ps(m);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        int c = 0;
        for (; c + 32 <= V; c += 32) {
            a0 = _mm512_add_ps(a0, exp_nonpos(_mm512_fmsub_ps(_mm512_loadu_ps(x + c), scv, mm)));
            a1 = _mm512_add_ps(a1, exp_nonpos(_mm512_fmsub_ps(_mm512_loadu_ps(x + c + 16), scv, mm)));
        }
        for (; c < V; c += 16) {
            const __mmask16 k = tail(V - c);
            a0 = _mm512_add_ps(a0, _mm512_maskz_mov_ps(k, exp_nonpos(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, x + c),
                                                                                      scv, mm))));
        }
        const double total = (double)_mm512_reduce_add_ps(a0) + (double)_mm512_reduce_add_ps(a1);
        const float l = m + (float)log(total);
        int token = arg;
        if (inv_t[r] > 0.0f) {
            const double target = (double)u[r] * total;
            double cum = 0.0;
            float e[16];
            token = V - 1;  /* where rounding leaves the target past every partial sum (u within 1e-7 of 1) */
            for (int b = 0; b < V; b += 16) {
                const __mmask16 k = tail(V - b);
                _mm512_storeu_ps(e, _mm512_maskz_mov_ps(k, exp_nonpos(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, x + b),
                                                                                        scv, mm))));
                const double block = (double)_mm512_reduce_add_ps(_mm512_loadu_ps(e));
                if (cum + block <= target) { cum += block; continue; }
                int j = 0;
                for (; j < 15 && b + j < V - 1; j++) {
                    cum += e[j];
                    if (cum > target) break;
                }
                token = b + j;
                break;
            }
        }
        tokens[r] = token;
        lse[r] = l;
        logprobs[r] = x[token] * sc - l;
    }
}
"""
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def _cpu_has_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and {"avx512f", "avx512bw", "avx512vl",
                                                                       "avx512dq"} <= cpu_flags()


def _signatures() -> dict[str, list]:
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    return {
        "add_rms_norm": [ptr, i64, ptr, i64, ptr, ptr, i32, i32, f32, i32],
        "rotary": [ptr, i64, i32, i32, ptr, ptr, ptr, i32, ptr, ptr, ptr, i32, i32],
        "silu_mul": [ptr, i64, ptr, i32, i32, i32],
        "slab_attention": [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr] + [i32] * 5 + [f32, i32],
        "sample_rows": [ptr, i64, ptr, ptr, ptr, ptr, ptr, i32, i32, i32],
    }


def _missing() -> str | None:
    return None if _cpu_has_avx512() else \
        f"the CPU lacks AVX-512 F/BW/VL/DQ (torch reports {torch.backends.cpu.get_cpu_capability()})"


KERNELS = KernelLibrary(SOURCE, FLAGS, "bf16_kernels", "the bf16 kernels", _signatures, _missing)
_load, _lib = KERNELS.load, KERNELS.lib
available = KERNELS.available  # whether the kernels run here, and if not, why


def _threads(elements: int, floor: int = PARALLEL_MIN_ELEMENTS) -> int:
    return torch.get_num_threads() if elements >= floor else 1


def _rows(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"bf16_kernels: {name} must be a bf16 CPU [rows, n] tensor of contiguous rows, got "
                         f"{tuple(t.shape)} strides {t.stride()} {t.dtype}")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] += delta (in place, rounded to bf16; no add without delta), then the RMS norm of x times weight,
    as a new [M, H] tensor."""
    _rows(x, "x")
    if delta is not None:
        _rows(delta, "delta")
    if not weight.is_contiguous() or weight.dtype != torch.bfloat16 or weight.numel() != x.shape[1]:
        raise ValueError(f"bf16_kernels.add_rms_norm: weight must be bf16 [{x.shape[1]}]")
    out = x.new_empty(x.shape)
    _lib().add_rms_norm(x.data_ptr(), x.stride(0), 0 if delta is None else delta.data_ptr(),
                        0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(),
                        x.shape[0], x.shape[1], eps, _threads(x.numel()))
    return out


def rotary(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor, kv_heads: int = 0, slots: torch.Tensor | None = None,
           k_pool: torch.Tensor | None = None, v_pool: torch.Tensor | None = None) -> None:
    """Rotate the first `heads` heads of head_dim of each row of x [N, >= heads * head_dim] in place at
    `positions` [N] (int64), from tables cos, sin [C, head_dim] (sin with rotate_half's sign). With pools
    (contiguous, [slots, kv_heads, head_dim] each), the last kv_heads of the rotated heads (the keys) and the
    kv_heads after them (the values) are also written to rows `slots` [N] (int64) of k_pool and v_pool."""
    _rows(x, "x")
    if head_dim % 2 or x.shape[1] < heads * head_dim or positions.dtype != torch.int64 \
            or not (cos.is_contiguous() and sin.is_contiguous() and positions.is_contiguous()):
        raise ValueError("bf16_kernels.rotary: an even head_dim, contiguous tables and int64 positions expected")
    pools = k_pool is not None
    if pools and not (k_pool.is_contiguous() and v_pool.is_contiguous() and slots.dtype == torch.int64
                      and slots.is_contiguous() and k_pool.numel() % (kv_heads * head_dim) == 0
                      and x.shape[1] >= (heads + kv_heads) * head_dim and kv_heads <= heads):
        raise ValueError("bf16_kernels.rotary: contiguous pools of kv_heads x head_dim rows and int64 slots expected")
    _lib().rotary(x.data_ptr(), x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                  x.shape[0], slots.data_ptr() if pools else 0, k_pool.data_ptr() if pools else 0,
                  v_pool.data_ptr() if pools else 0, kv_heads, _threads(x.shape[0] * heads * head_dim))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a gate/up GEMM output [M, 2I] (gate first) -> [M, I]."""
    _rows(gate_up, "gate_up")
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(m, i)
    _lib().silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), m, i, _threads(gate_up.numel()))
    return out


def slab_attention_fits(width: int, head_dim: int, group: int, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and width % 32 == 0 and head_dim % 16 == 0 and head_dim <= 256 and group <= 16


def slab_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
                   lens: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, scale: float) -> None:
    """`cpu_kernels.slab_attention` in bf16 (scratch stays fp32): the step's new keys and values k, v [B, kvH, D]
    go into kt [B, kvH, D, W] and vt [B, kvH, W, D] at lens - 1, then q [B, kvH * G, D] attends over each
    row's first lens[b] keys into out [B, kvH * G, D]."""
    b, heads, d = q.shape
    kvh, w = kt.shape[1], kt.shape[3]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != d or t.dtype != torch.bfloat16:
            raise ValueError(f"bf16_kernels.slab_attention: {name} must be bf16 rows of contiguous heads, got "
                             f"strides {t.stride()} {t.dtype}")
    if not (kt.is_contiguous() and vt.is_contiguous() and out.is_contiguous() and lens.dtype == torch.int32
            and lens.is_contiguous() and slab_attention_fits(w, d, heads // kvh, kt.dtype)
            and scratch.dtype == torch.float32 and scratch.numel() >= b * heads * w):
        raise ValueError("bf16_kernels.slab_attention: kt, vt, out, lens (int32) contiguous, W % 32 == 0, "
                         f"D % 16 == 0 and an fp32 scratch of {b * heads * w} expected")
    _lib().slab_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                          kt.data_ptr(), vt.data_ptr(), lens.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                          b, kvh, heads // kvh, d, w, scale, _threads(b * kvh * w * d, PARALLEL_MIN_KV))


def sample(logits: torch.Tensor, inv_t: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """One token per row of fp32 logits [S, V]: the first argmax where inv_t[r] == 0, else drawn from
    softmax(logits * inv_t[r]) at the uniform number u[r] (inverse CDF over the vocabulary in order).
    -> (tokens int64 [S], their log-probs [S], each row's log-normaliser [S]), in one pass of max, one of exp
    and, for drawn rows, a scan up to the token."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 or logits.device.type != "cpu":
        raise ValueError(f"bf16_kernels.sample: fp32 CPU logits [S, V] of contiguous rows expected, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    s, v = logits.shape
    inv_t, u = inv_t.to(torch.float32).contiguous(), u.to(torch.float32).contiguous()
    if inv_t.shape != (s,) or u.shape != (s,):
        raise ValueError(f"bf16_kernels.sample: inv_t and u must be [{s}]")
    tokens, logprobs, lse = torch.empty(s, dtype=torch.int64), torch.empty(s), torch.empty(s)
    _lib().sample_rows(logits.data_ptr(), logits.stride(0), inv_t.data_ptr(), u.data_ptr(), tokens.data_ptr(),
                       logprobs.data_ptr(), lse.data_ptr(), s, v, _threads(logits.numel()))
    return tokens, logprobs, lse

