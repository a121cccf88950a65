/* Helpers of the CPU kernels: a vectorisable exp, and per element type (f32, bf16) the loads,
   stores, roundings and the small dot-product tiles that dtype_kernels.h calls by suffix.
   AVX-512 (and AVX512-BF16) paths are chosen at compile time (-march=native). */

#ifndef STRATA_PRELUDE_H
#define STRATA_PRELUDE_H
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
/* acc[m][j] = sum over keys l < L of s[l][m] * v(key l)[off + j], j < 16 (float32), for the
   first `nl` lanes (a compile-time constant at each call: 4 or LANES); each lane's sum is its
   own, so computing fewer lanes changes none of the others. */
static inline __attribute__((always_inline)) void pv_f32(
    const float *s, const float *v, const int64_t *slot, int64_t off, int64_t L, float *acc,
    int nl) {
  float a[LANES][16];
  memset(a, 0, sizeof(a));
  for (int64_t l = 0; l < L; l++) {
    const float *vp = v + slot[l] + off, *sl = s + l * LANES;
    for (int64_t m = 0; m < nl; m++) {
      const float p = sl[m];
      #pragma omp simd
      for (int64_t j = 0; j < 16; j++) a[m][j] += p * vp[j];
    }
  }
  memcpy(acc, a, sizeof(a)); }
static inline void pairs_f32(float *s, int64_t L) { (void)s; (void)L; }
static inline int keys_task_f32(const float *q, const float *k, const float *v, const int64_t *slot,
                                 float *out, const int64_t *hs, int64_t L, int64_t HD, float scale,
                                 int64_t g, float *s, uint16_t *pb) {  /* the chunk task does it */
  (void)q; (void)k; (void)v; (void)slot; (void)out; (void)hs; (void)L; (void)HD; (void)scale;
  (void)g; (void)s; (void)pb; return 0; }

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
/* The 32 bf16 of x as vdpbf16ps pairs of its halves: lane j holds (x[j], x[16 + j]). Two rows
   of 16 dims (values of two keys) in the halves become dim j's pair; the AMX decode interleaves
   the even and odd k of 16 columns the same way. */
static inline __m512i pair_halves(__m512i x) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                         1, 16, 0);
  return _mm512_permutexvar_epi16(order, x); }
/* 16 dims of V at v0 and v1 (NULL: zeros), paired for vdpbf16ps (pair_halves). */
static inline __m512bh v_pairs(const uint16_t *v0, const uint16_t *v1) {
  const __m256i lo = _mm256_loadu_si256((const __m256i *)v0);
  const __m256i hi = v1 ? _mm256_loadu_si256((const __m256i *)v1) : _mm256_setzero_si256();
  return (__m512bh)pair_halves(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)); }
/* pv_f32 with bf16 probabilities (HF's eager path rounds them too): two keys per vdpbf16ps. */
static inline __attribute__((always_inline)) void pv_bf16(
    const float *s, const uint16_t *v, const int64_t *slot, int64_t off, int64_t L, float *acc,
    int nl) {
  const uint32_t *p = (const uint32_t *)s;
  __m512 a[LANES];
  for (int m = 0; m < nl; m++) a[m] = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; l += 2) {
    const __m512bh vv = v_pairs(v + slot[l] + off, l + 1 < L ? v + slot[l + 1] + off : NULL);
    const uint32_t *pl = p + (l / 2) * LANES;
    for (int m = 0; m < nl; m++)
      a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_set1_epi32((int)pl[m]), vv);
  }
  for (int m = 0; m < nl; m++) _mm512_storeu_ps(acc + m * 16, a[m]); }
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
/* r[j] lane i = r[i] lane j, for 16 rows of 16 int32 (unpack pairs, then quads, then a 4 x 4
   transpose of the 128-bit lanes). */
static inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  /* u[4q + c], 128-bit lane k: column 4k + c, rows 4q.. */
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; c++) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int i = 0; i < 16; i++) r[i] = t[i]; }
/* One decoded query row (the last of L positions, at q; out: its rows) x kv head g, computed
   with each query head's arithmetic exactly as the chunk task computes a one-token chunk, but
   with 16 keys in the lanes instead of 16 (query, head) pairs, of which a decoded row fills only
   its group's few: the same vdpbf16ps per (head, key) over the same dim pairs in the same order,
   the same exp, the sums over keys in key order, the same bf16 probability pairs and V sums.
   s: G * (L + 16) floats, pb: G * (L + 18) uint16 of scratch. Returns 0 (nothing done) where
   the shape does not fit: head_dim not a multiple of 32, or a group above 16 heads. */
static inline int keys_task_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                 const int64_t *slot, uint16_t *out, const int64_t *hs,
                                 int64_t L, int64_t HD, float scale, int64_t g, float *s,
                                 uint16_t *pb) {
  const int64_t G = hs[g + 1] - hs[g], P = HD / 2, Ls = L + 16, Lp = L + 18;
  if (HD % 32 || HD > KROW || G > 16 || G < 1) return 0;
  const uint32_t *qp = (const uint32_t *)(q + hs[g] * HD);  /* head h's pairs: qp + h * P */
  __m512 mx[16];
  for (int64_t h = 0; h < G; h++) mx[h] = _mm512_set1_ps(-INFINITY);
  for (int64_t l0 = 0; l0 < L; l0 += 16) {
    const int64_t cnt = L - l0 < 16 ? L - l0 : 16;
    const __mmask16 live = cnt == 16 ? 0xFFFF : (__mmask16)((1u << cnt) - 1);
    __m512 acc[16];
    for (int64_t h = 0; h < G; h++) acc[h] = _mm512_setzero_ps();
    for (int64_t j = l0 + 16; j < l0 + 32 && j < L; j++)  /* the next 16 keys' rows */
      for (int64_t c = 0; c < HD * 2; c += 64) __builtin_prefetch((const char *)(k + slot[j] + g * HD) + c);
    for (int64_t b = 0; b < P; b += 16) {  /* dim pairs b .. b + 15 of 16 keys, transposed */
      __m512i r[16];
      for (int64_t j = 0; j < 16; j++)
        r[j] = j < cnt ? _mm512_loadu_si512(k + slot[l0 + j] + g * HD + 2 * b)
                       : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t i = 0; i < 16; i++)
        for (int64_t h = 0; h < G; h++)
          acc[h] = _mm512_dpbf16_ps(acc[h], (__m512bh)_mm512_set1_epi32((int)qp[h * P + b + i]),
                                    (__m512bh)r[i]);
    }
    for (int64_t h = 0; h < G; h++) {
      const __m512 x = _mm512_mul_ps(acc[h], _mm512_set1_ps(scale));
      _mm512_storeu_ps(s + h * Ls + l0, x);
      mx[h] = _mm512_mask_max_ps(mx[h], live, mx[h], x);
    }
  }
  float sum[16];
  for (int64_t h = 0; h < G; h++) {
    float *sh = s + h * Ls;
    uint16_t *ph = pb + h * Lp;
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx[h]));
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
      const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(sh + l0), m));
      _mm512_storeu_ps(sh + l0, e);
      _mm256_storeu_si256((__m256i *)(ph + l0), (__m256i)_mm512_cvtneps_pbh(e));
    }
    ph[L] = 0;  /* an odd last key pairs with a zero, as in pairs_bf16 */
    float total = 0.f;  /* in key order: the chunk task's per-lane sum */
    for (int64_t l = 0; l < L; l++) total += sh[l];
    sum[h] = total;
  }
  for (int64_t h0 = 0; h0 < G; h0 += 4)  /* 4 heads x 64 dims of V sums at a time */
    for (int64_t d0 = 0; d0 < HD; d0 += 64) {
      const int nd = HD - d0 < 64 ? (int)((HD - d0) / 16) : 4;
      __m512 a[4][4];
      for (int h = 0; h < 4; h++)
        for (int c = 0; c < 4; c++) a[h][c] = _mm512_setzero_ps();
      for (int64_t l = 0; l < L; l += 2) {
        if (l + 8 < L)
          for (int64_t c = 0; c < nd * 32; c += 64)
            __builtin_prefetch((const char *)(v + slot[l + 8] + g * HD + d0) + c);
        if (l + 9 < L)
          for (int64_t c = 0; c < nd * 32; c += 64)
            __builtin_prefetch((const char *)(v + slot[l + 9] + g * HD + d0) + c);
        const uint16_t *v0 = v + slot[l] + g * HD + d0;
        const uint16_t *v1 = l + 1 < L ? v + slot[l + 1] + g * HD + d0 : 0;
        __m512 pp[4];
        for (int h = 0; h < 4; h++) {
          int32_t pair = 0;  /* probabilities l, l + 1 of head h0 + h (none past the group) */
          if (h0 + h < G) memcpy(&pair, pb + (h0 + h) * Lp + l, 4);
          pp[h] = (__m512)_mm512_set1_epi32(pair);
        }
        for (int c = 0; c < nd; c++) {
          const __m512bh vv = v_pairs(v0 + 16 * c, v1 ? v1 + 16 * c : NULL);
          for (int h = 0; h < 4; h++) a[h][c] = _mm512_dpbf16_ps(a[h][c], (__m512bh)pp[h], vv);
        }
      }
      for (int h = 0; h < 4 && h0 + h < G; h++) {
        const float inv = 1.f / sum[h0 + h];
        uint16_t *o = out + (hs[g] + h0 + h) * HD + d0;
        for (int c = 0; c < nd; c++) {
          float x[16];
          _mm512_storeu_ps(x, _mm512_mul_ps(a[h][c], _mm512_set1_ps(inv)));
          for (int j = 0; j < 16; j++) st_bf16(o, 16 * c + j, x[j]);
        }
      }
    }
  return 1; }
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
static inline int keys_task_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *slot,
                                 uint16_t *out, const int64_t *hs, int64_t L, int64_t HD, float scale,
                                 int64_t g, float *s, uint16_t *pb) {  /* the chunk task does it */
  (void)q; (void)k; (void)v; (void)slot; (void)out; (void)hs; (void)L; (void)HD; (void)scale;
  (void)g; (void)s; (void)pb; return 0; }

static inline __attribute__((always_inline)) void pv_bf16(
    const float *s, const uint16_t *v, const int64_t *slot, int64_t off, int64_t L, float *acc,
    int nl) {
  float a[LANES][16];
  memset(a, 0, sizeof(a));
  for (int64_t l = 0; l < L; l++) {
    const uint16_t *vp = v + slot[l] + off;
    const float *sl = s + l * LANES;
    float vf[16];
    for (int64_t j = 0; j < 16; j++) vf[j] = ld_bf16(vp, j);
    for (int64_t m = 0; m < nl; m++) {
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

#endif
