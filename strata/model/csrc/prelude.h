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
static inline __attribute__((always_inline)) void pv_bf16(
    const float *s, const uint16_t *v, const int64_t *slot, int64_t off, int64_t L, float *acc,
    int nl) {
  static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_loadu_si512(order);
  const uint32_t *p = (const uint32_t *)s;
  __m512 a[LANES];
  for (int m = 0; m < nl; m++) a[m] = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; l += 2) {
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(v + slot[l] + off));
    const __m256i v1 = l + 1 < L ? _mm256_loadu_si256((const __m256i *)(v + slot[l + 1] + off))
                                 : _mm256_setzero_si256();
    const __m512bh vv = (__m512bh)_mm512_permutexvar_epi16(
        idx, _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1));
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
