"""CPU kernels in C: paged decode attention and a fused residual-add + RMSNorm.

Paged decode attention: the torch path gathers every decode row's K and V into padded
(D, L, ...) tensors, per layer, per step, then runs a masked SDPA: three passes over the KV bytes
and a slow masked kernel. This kernel reads each cached key and value once, in place, in float32,
with OpenMP over decode rows.

The fused add + norm replaces about nine torch ops (each a pass over memory and a dispatch) with
one, keeping HF's bf16 rounding points: 3x faster than the torch ops at 32 and 512 rows.

The library is compiled at first use with the system C compiler (a plain C file, under a
second) into a private temporary directory and loaded with ctypes; it links `libgomp.so.1` by
soname, so it shares torch's already-loaded OpenMP runtime and thread count. When no compiler
is available, `supports` is false and callers use their torch paths.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

_KERNEL = r"""
void NAME(const T *q, const T *k, const T *v, const int64_t *table, const int64_t *lens,
          T *out, int64_t q_stride, int64_t D, int64_t H, int64_t KVH, int64_t HD, int64_t bs,
          int64_t W, float scale) {
  const int64_t G = H / KVH, stride = KVH * HD;
  int64_t maxL = 1;
  for (int64_t d = 0; d < D; d++) if (lens[d] > maxL) maxL = lens[d];
  #pragma omp parallel
  {
    float *s = malloc(sizeof(float) * H * maxL);
    float *qf = malloc(sizeof(float) * H * HD);
    float *acc = malloc(sizeof(float) * H * HD);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t d = 0; d < D; d++) {
      /* One task per sequence: every slot's K (then V) row of all kv heads is read once,
         contiguously, while the next block is prefetched. */
      const int64_t L = lens[d], nb = (L + bs - 1) / bs;
      const int64_t *row = table + d * W;
      const T *qd = q + d * q_stride;
      for (int64_t i = 0; i < H * HD; i++) { qf[i] = LD(qd, i); acc[i] = 0.f; }
      for (int64_t b = 0, l = 0; b < nb; b++) {
        const T *kb = k + row[b] * bs * stride;
        const char *next = b + 1 < nb ? (const char *)(k + row[b + 1] * bs * stride) : 0;
        for (int64_t j = 0; j < bs && l < L; j++, l++) {
          const T *kp = kb + j * stride;
          if (next) for (int64_t c = 0; c < stride * (int64_t)sizeof(T); c += 64)
            __builtin_prefetch(next + j * stride * sizeof(T) + c);
          for (int64_t hg = 0; hg < H; hg++)
            s[hg * maxL + l] = DOT(qd + hg * HD, qf + hg * HD, kp + (hg / G) * HD, HD) * scale;
        }
      }
      for (int64_t hg = 0; hg < H; hg++) {
        float *sg = s + hg * maxL, m = sg[0], sum = 0.f;
        for (int64_t l = 1; l < L; l++) m = sg[l] > m ? sg[l] : m;
        sum = exp_sum(sg, L, m);
        const float inv = 1.f / sum;
        for (int64_t l = 0; l < L; l++) sg[l] *= inv;
      }
      for (int64_t b = 0, l = 0; b < nb; b++) {
        const T *vb = v + row[b] * bs * stride;
        const char *next = b + 1 < nb ? (const char *)(v + row[b + 1] * bs * stride) : 0;
        for (int64_t j = 0; j < bs && l < L; j++, l++) {
          const T *vp = vb + j * stride;
          if (next) for (int64_t c = 0; c < stride * (int64_t)sizeof(T); c += 64)
            __builtin_prefetch(next + j * stride * sizeof(T) + c);
          for (int64_t hg = 0; hg < H; hg++) {
            const float p = s[hg * maxL + l];
            const T *vh = vp + (hg / G) * HD;
            float *ag = acc + hg * HD;
            #pragma omp simd
            for (int64_t i = 0; i < HD; i++) ag[i] += p * LD(vh, i);
          }
        }
      }
      T *od = out + d * H * HD;
      for (int64_t i = 0; i < H * HD; i++) ST(od, i, acc[i]);
    }
    free(s); free(qf); free(acc);
  }
}

/* A chunk of n new tokens of one sequence at positions start .. start + n - 1, attending to
   positions 0 .. own position through one block-table row. Work item = one kv head x a tile of
   LANES (query, group head) pairs; the tile's keys are read once and scored for all its lanes
   (vectorised across lanes), softmax in float32, then V is accumulated 16 dims at a time. */
void NAME_chunk(const T *q, const T *k, const T *v, const int64_t *table, T *out,
                int64_t q_stride, int64_t n, int64_t start, int64_t H, int64_t KVH, int64_t HD,
                int64_t bs, float scale) {
  const int64_t G = H / KVH, stride = KVH * HD, lanes = n * G, maxL = start + n;
  const int64_t tiles = (lanes + LANES - 1) / LANES;
  int64_t *slot = malloc(sizeof(int64_t) * maxL);
  for (int64_t l = 0; l < maxL; l++) slot[l] = (table[l / bs] * bs + l % bs) * stride;
  #pragma omp parallel if (KVH * tiles > 1)
  {
    float *s = malloc(sizeof(float) * LANES * (maxL + KEYS));
    float *qt = malloc(sizeof(float) * LANES * HD);
    T *kb = calloc(KEYS * KROW, sizeof(T));
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < KVH * tiles; task++) {
      const int64_t g = task / tiles, m0 = (task % tiles) * LANES;
      const int64_t cnt = lanes - m0 < LANES ? lanes - m0 : LANES;
      int64_t qpos[LANES];
      float mx[LANES], sum[LANES];
      for (int64_t m = 0; m < LANES; m++) {  /* padding lanes repeat the tile's first lane */
        const int64_t lane = m0 + (m < cnt ? m : 0), i = lane / G, h = g * G + lane % G;
        const T *qh = q + i * q_stride + h * HD;
        qpos[m] = start + i;
        QPACK(qt, m, qh, HD);
        mx[m] = -INFINITY;
        sum[m] = 0.f;
      }
      const int64_t L = qpos[cnt - 1] + 1;  /* lanes are in position order */
      for (int64_t l0 = 0; l0 < L; l0 += KEYS) {  /* KEYS keys at once: independent sums */
        for (int64_t j = 0; j < KEYS && l0 + j < L; j++)  /* rows at fixed offsets */
          memcpy(kb + j * KROW, k + slot[l0 + j] + g * HD, sizeof(T) * HD);
        QK(qt, kb, HD, s + l0 * LANES);
        for (int64_t l = l0; l < l0 + KEYS && l < L; l++) {
          float *sl = s + l * LANES;
          #pragma omp simd
          for (int64_t m = 0; m < LANES; m++) {
            const float x = l <= qpos[m] ? sl[m] * scale : -INFINITY;
            sl[m] = x;
            mx[m] = x > mx[m] ? x : mx[m];
          }
        }
      }
      exp_lanes(s, mx, sum, L);
      PAIRS(s, L);
      for (int64_t d0 = 0; d0 < HD; d0 += 16) {
        float acc[LANES][16];
        PV(s, v, slot, g * HD + d0, L, &acc[0][0]);
        for (int64_t m = 0; m < cnt; m++) {
          const int64_t lane = m0 + m, i = lane / G, h = g * G + lane % G;
          const float inv = 1.f / sum[m];
          T *o = out + (i * H + h) * HD + d0;
          for (int64_t j = 0; j < 16; j++) ST(o, j, acc[m][j] * inv);
        }
      }
    }
    free(s); free(qt); free(kb);
  }
  free(slot);
}

/* x += delta (rounded to T, skipped when delta is NULL);
   out = weight * T(x * rsqrt(mean x^2 + eps)): the rounding steps of HF's add and RMSNorm. */
void NAME_add_rms_norm(T *x, const T *delta, const T *w, T *out, int64_t rows, int64_t n,
                       float eps) {
  #pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; r++) {
    T *xr = x + r * n, *o = out + r * n;
    float ss = 0.f;
    if (delta) {
      const T *dr = delta + r * n;
      #pragma omp simd
      for (int64_t i = 0; i < n; i++) ST(xr, i, LD(xr, i) + LD(dr, i));
    }
    #pragma omp simd reduction(+:ss)
    for (int64_t i = 0; i < n; i++) { const float v = LD(xr, i); ss += v * v; }
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) ST(o, i, RT(LD(xr, i) * inv) * LD(w, i));
  }
}
"""

_PRELUDE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#define LANES 16
/* exp(x) for x <= 0 (Cephes' polynomial, ~2 ulp), 0 below -87; branch-free so that loops
   over it vectorise, unlike libm's expf. */
static inline float exp_neg(float x) {
  const float n = floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t e = (int32_t)(x < -87.f ? 0.f : n) + 127;
  uint32_t u = (uint32_t)e << 23; float scale; memcpy(&scale, &u, 4);
  return x < -87.f ? 0.f : p * scale; }
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 exp_neg16(__m512 x) {  /* exp_neg on 16 lanes; scalef does the 2^n */
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n)); }
/* x[i] = exp(x[i] - m) for i < n; returns their sum. */
static inline float exp_sum(float *x, int64_t n, float m) {
  __m512 acc = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp_neg16(_mm512_sub_ps(
        _mm512_maskz_loadu_ps(k, x + i), mv)));
    _mm512_mask_storeu_ps(x + i, k, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc); }
/* Softmax numerators of LANES lanes over L keys (s is [L][LANES]); sum[m] += each lane's. */
static inline void exp_lanes(float *s, const float *mx, float *sum, int64_t L) {
  const __m512 mv = _mm512_loadu_ps(mx);
  __m512 acc = _mm512_loadu_ps(sum);
  for (int64_t l = 0; l < L; l++) {
    const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + l * LANES), mv));
    _mm512_storeu_ps(s + l * LANES, e);
    acc = _mm512_add_ps(acc, e);
  }
  _mm512_storeu_ps(sum, acc); }
#else
static inline float exp_sum(float *x, int64_t n, float m) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; i++) { x[i] = exp_neg(x[i] - m); sum += x[i]; }
  return sum; }
static inline void exp_lanes(float *s, const float *mx, float *sum, int64_t L) {
  for (int64_t l = 0; l < L; l++)
    for (int64_t m = 0; m < LANES; m++) {
      const float e = exp_neg(s[l * LANES + m] - mx[m]);
      s[l * LANES + m] = e;
      sum[m] += e;
    } }
#endif
static inline float ld_bf16(const uint16_t *p, int64_t i) {
  uint32_t u = (uint32_t)p[i] << 16; float f; memcpy(&f, &u, 4); return f; }
static inline void st_bf16(uint16_t *p, int64_t i, float f) {  /* round to nearest even */
  uint32_t u; memcpy(&u, &f, 4); u += 0x7FFFu + ((u >> 16) & 1u); p[i] = (uint16_t)(u >> 16); }
static inline float rt_bf16(float f) { uint16_t b; st_bf16(&b, 0, f); return ld_bf16(&b, 0); }
static inline float ld_f32(const float *p, int64_t i) { return p[i]; }
static inline float rt_f32(float f) { return f; }
static inline void st_f32(float *p, int64_t i, float f) { p[i] = f; }
static inline float dot_f32(const float *qraw, const float *qf, const float *kp, int64_t n) {
  float dot = 0.f;
  #pragma omp simd reduction(+:dot)
  for (int64_t i = 0; i < n; i++) dot += qf[i] * kp[i];
  return dot; }
#define KEYS 8
#define KROW 256  /* the chunk kernel's key rows: head_dim <= KROW */
typedef int32_t __attribute__((may_alias)) alias_i32;
/* Chunk-kernel query tiles: lane m's query, transposed (dim-major) for vectorising over lanes. */
static inline void qpack_f32(float *qt, int64_t m, const float *qh, int64_t HD) {
  for (int64_t d = 0; d < HD; d++) qt[d * LANES + m] = qh[d]; }
/* out[j][m] = q(lane m) . key j for KEYS keys at kb + j * KROW (KEYS independent sums). */
static inline void qk_f32(const float *qt, const float *kb, int64_t HD, float *out) {
  float a[KEYS][LANES];
  memset(a, 0, sizeof(a));
  for (int64_t d = 0; d < HD; d++)
    for (int64_t j = 0; j < KEYS; j++) {
      const float kd = kb[j * KROW + d];
      #pragma omp simd
      for (int64_t m = 0; m < LANES; m++) a[j][m] += qt[d * LANES + m] * kd;
    }
  memcpy(out, a, sizeof(a)); }
/* acc[m][j] = sum over keys l < L of s[l][m] * v(key l)[off + j], j < 16 (float32). */
static inline void pv_f32(const float *s, const float *v, const int64_t *slot, int64_t off,
                          int64_t L, float *acc) {
  float a[LANES][16];
  memset(a, 0, sizeof(a));
  for (int64_t l = 0; l < L; l++) {
    const float *vp = v + slot[l] + off, *sl = s + l * LANES;
    for (int64_t m = 0; m < LANES; m++) {
      const float p = sl[m];
      #pragma omp simd
      for (int64_t j = 0; j < 16; j++) a[m][j] += p * vp[j];
    }
  }
  memcpy(acc, a, sizeof(a)); }
static inline void pairs_f32(float *s, int64_t L) { (void)s; (void)L; }
#if defined(__AVX512BF16__)
#include <immintrin.h>
/* Probability rows l, l + 1 become row l / 2 of bf16 pairs (in place): vdpbf16ps operands. */
static inline void pairs_bf16(float *s, int64_t L) {
  uint32_t *p = (uint32_t *)s;
  for (int64_t l = 0; l < L; l += 2) {
    const __m512 e0 = _mm512_loadu_ps(s + l * LANES);
    const __m512 e1 = l + 1 < L ? _mm512_loadu_ps(s + (l + 1) * LANES) : _mm512_setzero_ps();
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
    _mm512_storeu_si512(p + (l / 2) * LANES, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  } }
/* pv_f32 with bf16 probabilities (HF's eager path rounds them too): two keys per vdpbf16ps. */
static inline void pv_bf16(const float *s, const uint16_t *v, const int64_t *slot, int64_t off,
                           int64_t L, float *acc) {
  static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_loadu_si512(order);
  const uint32_t *p = (const uint32_t *)s;
  __m512 a[LANES];
  for (int64_t m = 0; m < LANES; m++) a[m] = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; l += 2) {
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(v + slot[l] + off));
    const __m256i v1 = l + 1 < L ? _mm256_loadu_si256((const __m256i *)(v + slot[l + 1] + off))
                                 : _mm256_setzero_si256();
    const __m512bh vv = (__m512bh)_mm512_permutexvar_epi16(
        idx, _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1));
    const uint32_t *pl = p + (l / 2) * LANES;
    for (int64_t m = 0; m < LANES; m++)
      a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_set1_epi32((int)pl[m]), vv);
  }
  for (int64_t m = 0; m < LANES; m++) _mm512_storeu_ps(acc + m * 16, a[m]); }
/* bf16: lanes hold raw (q[2i], q[2i+1]) pairs, the operand layout of vdpbf16ps. */
static inline void qpack_bf16(float *qt, int64_t m, const uint16_t *qh, int64_t HD) {
  uint32_t *t = (uint32_t *)qt; const uint32_t *p = (const uint32_t *)qh;
  for (int64_t i = 0; i < HD / 2; i++) t[i * LANES + m] = p[i]; }
static inline void qk_bf16(const float *qt, const uint16_t *kb, int64_t HD, float *out) {
  const uint32_t *t = (const uint32_t *)qt;
  __m512 a[KEYS];
  for (int64_t j = 0; j < KEYS; j++) a[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < HD / 2; i++) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(t + i * LANES);
    for (int64_t j = 0; j < KEYS; j++) {
      const int32_t pair = ((const alias_i32 *)(kb + j * KROW))[i];
      a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
  for (int64_t j = 0; j < KEYS; j++) _mm512_storeu_ps(out + j * LANES, a[j]); }
static inline float dot_bf16(const uint16_t *qraw, const float *qf, const uint16_t *kp,
                             int64_t n) {  /* bf16 x bf16 products are exact in float32 */
  if (n % 32 == 0) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qraw + i),
                           (__m512bh)_mm512_loadu_si512(kp + i));
    return _mm512_reduce_add_ps(a);
  }
  float dot = 0.f;
  for (int64_t i = 0; i < n; i++) dot += qf[i] * ld_bf16(kp, i);
  return dot; }
#else
static inline void pairs_bf16(float *s, int64_t L) { (void)s; (void)L; }
static inline void pv_bf16(const float *s, const uint16_t *v, const int64_t *slot, int64_t off,
                           int64_t L, float *acc) {
  float a[LANES][16];
  memset(a, 0, sizeof(a));
  for (int64_t l = 0; l < L; l++) {
    const uint16_t *vp = v + slot[l] + off;
    const float *sl = s + l * LANES;
    float vf[16];
    for (int64_t j = 0; j < 16; j++) vf[j] = ld_bf16(vp, j);
    for (int64_t m = 0; m < LANES; m++) {
      const float p = sl[m];
      #pragma omp simd
      for (int64_t j = 0; j < 16; j++) a[m][j] += p * vf[j];
    }
  }
  memcpy(acc, a, sizeof(a)); }
static inline void qpack_bf16(float *qt, int64_t m, const uint16_t *qh, int64_t HD) {
  for (int64_t d = 0; d < HD; d++) qt[d * LANES + m] = ld_bf16(qh, d); }
static inline void qk_bf16(const float *qt, const uint16_t *kb, int64_t HD, float *out) {
  float a[KEYS][LANES];
  memset(a, 0, sizeof(a));
  for (int64_t d = 0; d < HD; d++)
    for (int64_t j = 0; j < KEYS; j++) {
      const float kd = ld_bf16(kb + j * KROW, d);
      #pragma omp simd
      for (int64_t m = 0; m < LANES; m++) a[j][m] += qt[d * LANES + m] * kd;
    }
  memcpy(out, a, sizeof(a)); }
static inline float dot_bf16(const uint16_t *qraw, const float *qf, const uint16_t *kp,
                             int64_t n) {
  float dot = 0.f;
  #pragma omp simd reduction(+:dot)
  for (int64_t i = 0; i < n; i++) dot += qf[i] * ld_bf16(kp, i);
  return dot; }
#endif
"""

_VARIANTS = {torch.bfloat16: ("decode_bf16", "uint16_t", "bf16"),
             torch.float32: ("decode_f32", "float", "f32")}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _source() -> str:
    parts = [_PRELUDE]
    for name, ctype, suffix in _VARIANTS.values():
        parts.append(_KERNEL.replace("NAME", name).replace("T *", f"{ctype} *")
                     .replace("sizeof(T)", f"sizeof({ctype})")
                     .replace("LD(", f"ld_{suffix}(").replace("ST(", f"st_{suffix}(")
                     .replace("DOT(", f"dot_{suffix}(").replace("RT(", f"rt_{suffix}(")
                     .replace("QPACK(", f"qpack_{suffix}(").replace("QK(", f"qk_{suffix}(")
                     .replace("PAIRS(", f"pairs_{suffix}(").replace("PV(", f"pv_{suffix}("))
    return "\n".join(parts)


def _compile() -> ctypes.CDLL | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: attention and norms use the slower torch paths")
        return None
    # The directory goes once the library is loaded: the mapping outlives the file.
    with tempfile.TemporaryDirectory(prefix="strata-kernels-") as tmp:
        src, lib = Path(tmp) / "cpu_kernels.c", Path(tmp) / "cpu_kernels.so"
        src.write_text(_source())
        cmd = [cc, "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC",
               str(src), "-o", str(lib), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            log.warning("compiling the CPU kernels failed (%s); using the torch paths",
                        done.stderr.strip()[-500:])
            return None
        handle = ctypes.CDLL(str(lib))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name, *_ in _VARIANTS.values():
        _declare(handle, name, [ptr] * 6 + [i64] * 7 + [ctypes.c_float])
        _declare(handle, f"{name}_add_rms_norm", [ptr] * 4 + [i64] * 2 + [ctypes.c_float])
        _declare(handle, f"{name}_chunk", [ptr] * 5 + [i64] * 7 + [ctypes.c_float])
    return handle


def _declare(handle: ctypes.CDLL, name: str, argtypes: list) -> None:
    fn = getattr(handle, name)
    fn.argtypes = argtypes
    fn.restype = None


def kernel_library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first call; None when they cannot be built."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            _lib = _compile()
    return _lib


def supports(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether `decode_attention` runs for tensors of this dtype on this device."""
    return (torch.device(device).type == "cpu" and dtype in _VARIANTS
            and kernel_library() is not None)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                     context_lens: Tensor, block_size: int) -> Tensor:
    """Attention of one query row per sequence over its cached positions 0 .. len - 1.

    q: (D, heads, head_dim), rows may be strided; k_cache, v_cache: (slots, kv_heads, head_dim),
    contiguous; block_table: (D, W) int64; context_lens: (D,) int64. Returns (D, heads, head_dim).
    Call only when `supports(q.dtype, q.device)` is true.
    """
    lib = kernel_library()
    assert lib is not None, "invariant kernel_built: check supports() first"
    d, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    fn = getattr(lib, _VARIANTS[q.dtype][0])
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
       context_lens.data_ptr(), out.data_ptr(), q.stride(0), d, heads, k_cache.shape[1], head_dim,
       block_size, block_table.shape[1], head_dim ** -0.5)
    return out


def supports_chunk(dtype: torch.dtype, device: torch.device | str, head_dim: int) -> bool:
    """Whether `chunk_attention` runs: `supports`, and head_dim a multiple of 16, <= 256."""
    return head_dim % 16 == 0 and head_dim <= 256 and supports(dtype, device)


def chunk_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_row: Tensor,
                    start_pos: int, block_size: int) -> Tensor:
    """Causal attention of n new tokens of one sequence at positions start_pos .. + n - 1.

    Query i attends to the cached positions 0 .. start_pos + i (its own K/V already written),
    read in place through `block_row` (W,) int64. q: (n, heads, head_dim), rows may be strided;
    returns (n, heads, head_dim). Call only when `supports_chunk(...)` is true.
    """
    lib = kernel_library()
    assert lib is not None, "invariant kernel_built: check supports_chunk() first"
    n, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    fn = getattr(lib, f"{_VARIANTS[q.dtype][0]}_chunk")
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_row.data_ptr(),
       out.data_ptr(), q.stride(0), n, start_pos, heads, k_cache.shape[1], head_dim, block_size,
       head_dim ** -0.5)
    return out


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """`x += delta` in place (when given), then RMSNorm(x) * weight, rounded as HF rounds.

    x, delta: (rows, n) contiguous of one dtype; weight: (n,). Requires `supports(x.dtype, ...)`.
    """
    lib = kernel_library()
    assert lib is not None, "invariant kernel_built: check supports() first"
    assert x.is_contiguous() and (delta is None or delta.is_contiguous())
    out = torch.empty_like(x)
    fn = getattr(lib, f"{_VARIANTS[x.dtype][0]}_add_rms_norm")
    fn(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
       out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out

