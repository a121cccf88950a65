/* The kernels of one element type, included once per type by cpu_kernels.c with
     T    the element type in memory (float, or uint16_t holding bfloat16 bits),
     SFX  its suffix (f32, bf16), naming the helpers of prelude.h that load, store, round and
          multiply T (ld_SFX, st_SFX, rt_SFX, dot_SFX, qpack_SFX, qk_SFX, pairs_SFX, pv_SFX).
   Defines decode_SFX (paged decode attention), decode_SFX_chunk (causal attention of a chunk of
   new tokens of one sequence) and decode_SFX_add_rms_norm (fused residual add + RMSNorm), the
   symbols that strata/model/cpu_kernels.py calls through ctypes; undefines T and SFX at the end. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define NAME CAT(decode_, SFX)
#define LD CAT(ld_, SFX)
#define ST CAT(st_, SFX)
#define RT CAT(rt_, SFX)
#define DOT CAT(dot_, SFX)
#define QPACK CAT(qpack_, SFX)
#define QK CAT(qk_, SFX)
#define PAIRS CAT(pairs_, SFX)
#define PV CAT(pv_, SFX)
#define KTASK CAT(keys_task_, SFX)

/* Decode attention: one query row per sequence d attends to its cached positions
   0 .. lens[d] - 1, read in place through row d of the block table (W columns).
   KV head g serves query heads hs[g] .. hs[g + 1] - 1 (KVH + 1 entries; groups may differ in
   size on a tensor-parallel rank). */
void NAME(const T *q, const T *k, const T *v, const int64_t *table, const int64_t *lens,
          T *out, const int64_t *hs, int64_t q_stride, int64_t D, int64_t H, int64_t KVH,
          int64_t HD, int64_t bs, int64_t W, float scale) {
  const int64_t stride = KVH * HD;
  int64_t *kv_of = malloc(sizeof(int64_t) * H);
  for (int64_t g = 0; g < KVH; g++)
    for (int64_t h = hs[g]; h < hs[g + 1]; h++) kv_of[h] = g;
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
            s[hg * maxL + l] = DOT(qd + hg * HD, qf + hg * HD, kp + kv_of[hg] * HD, HD) * scale;
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
            const T *vh = vp + kv_of[hg] * HD;
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
  free(kv_of);
}

/* One work item of the chunk kernel: kv head g x the LANES (query, group head) pairs from
   lane m0 of a chunk of n new tokens at positions start .. start + n - 1 (q, out: the chunk's
   first row; slot[l]: the cache offset of position l). The tile's keys are read once and scored
   for all its lanes (vectorised across lanes), softmax in float32, then V is accumulated 16 dims
   at a time. Each lane's arithmetic is its own: keys past a lane's position score -inf and add
   exact zeros, so a query's result does not depend on the lanes, the chunk or the step it
   shares. s, qt, kb: the caller's scratch (LANES * (start + n + KEYS), LANES * HD, KEYS * KROW). */
static void CAT(NAME, _chunk_task)(const T *q, const T *k, const T *v, const int64_t *slot,
                                   T *out, const int64_t *hs, int64_t q_stride, int64_t n,
                                   int64_t start, int64_t H, int64_t HD, float scale, int64_t g,
                                   int64_t m0, float *s, float *qt, T *kb) {
  const int64_t G = hs[g + 1] - hs[g], lanes = n * G;
  const int64_t cnt = lanes - m0 < LANES ? lanes - m0 : LANES;
  int64_t qpos[LANES];
  float mx[LANES], sum[LANES];
  for (int64_t m = 0; m < LANES; m++) {  /* padding lanes repeat the tile's first lane */
    const int64_t lane = m0 + (m < cnt ? m : 0), i = lane / G, h = hs[g] + lane % G;
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
    if (cnt <= 4) PV(s, v, slot, g * HD + d0, L, &acc[0][0], 4);  /* a decoded row's group */
    else PV(s, v, slot, g * HD + d0, L, &acc[0][0], LANES);
    for (int64_t m = 0; m < cnt; m++) {
      const int64_t lane = m0 + m, i = lane / G, h = hs[g] + lane % G;
      const float inv = 1.f / sum[m];
      T *o = out + (i * H + h) * HD + d0;
      for (int64_t j = 0; j < 16; j++) ST(o, j, acc[m][j] * inv);
    }
  } }

/* A chunk of n new tokens of one sequence at positions start .. start + n - 1, attending to
   positions 0 .. own position through one block-table row. Work item = one kv head x a tile of
   LANES (query, group head) pairs (the chunk task above). KV head g serves query heads
   hs[g] .. hs[g + 1] - 1, as in the decode kernel. */
void CAT(NAME, _chunk)(const T *q, const T *k, const T *v, const int64_t *table, T *out,
                const int64_t *hs, int64_t q_stride, int64_t n, int64_t start, int64_t H,
                int64_t KVH, int64_t HD, int64_t bs, float scale) {
  const int64_t stride = KVH * HD, maxL = start + n;
  int64_t *first_task = malloc(sizeof(int64_t) * (KVH + 1));  /* kv head g: its first task */
  first_task[0] = 0;
  for (int64_t g = 0; g < KVH; g++)
    first_task[g + 1] = first_task[g] + (n * (hs[g + 1] - hs[g]) + LANES - 1) / LANES;
  const int64_t tasks = first_task[KVH];
  int64_t *slot = malloc(sizeof(int64_t) * maxL);
  for (int64_t l = 0; l < maxL; l++) slot[l] = (table[l / bs] * bs + l % bs) * stride;
  #pragma omp parallel if (tasks > 1)
  {
    float *s = malloc(sizeof(float) * LANES * (maxL + KEYS));
    float *qt = malloc(sizeof(float) * LANES * HD);
    T *kb = calloc(KEYS * KROW, sizeof(T));
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
      int64_t g = 0;
      while (first_task[g + 1] <= task) g++;
      CAT(NAME, _chunk_task)(q, k, v, slot, out, hs, q_stride, n, start, H, HD, scale, g,
                             (task - first_task[g]) * LANES, s, qt, kb);
    }
    free(s); free(qt); free(kb);
  }
  free(slot);
  free(first_task);
}

/* Decode attention with the chunk kernel's arithmetic: sequence d's one query row, at position
   lens[d] - 1, is a chunk of one token (the chunk task), so its result is bit for bit what a
   prefill of that position computes, alone or in any chunk (`strata serve --deterministic`:
   a resumed stream or a hand-off recomputes decoded tokens as a prefill). Arguments as for the
   decode kernel. */
void CAT(NAME, _lanes)(const T *q, const T *k, const T *v, const int64_t *table,
                       const int64_t *lens, T *out, const int64_t *hs, int64_t q_stride,
                       int64_t D, int64_t H, int64_t KVH, int64_t HD, int64_t bs, int64_t W,
                       float scale) {
  const int64_t stride = KVH * HD;
  int64_t maxL = 1;
  for (int64_t d = 0; d < D; d++) if (lens[d] > maxL) maxL = lens[d];
  #pragma omp parallel if (D * KVH > 1)
  {
    float *s = malloc(sizeof(float) * LANES * (maxL + KEYS));
    float *qt = malloc(sizeof(float) * LANES * HD);
    T *kb = calloc(KEYS * KROW, sizeof(T));
    int64_t *slot = malloc(sizeof(int64_t) * maxL);
    float *ks = malloc(sizeof(float) * 16 * (maxL + 16));
    uint16_t *pb = malloc(sizeof(uint16_t) * 16 * (maxL + 18));
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < D * KVH; task++) {  /* a sequence x a kv head */
      const int64_t d = task / KVH, g = task % KVH, L = lens[d], *row = table + d * W;
      for (int64_t l = 0; l < L; l++) slot[l] = (row[l / bs] * bs + l % bs) * stride;
      if (KTASK(q + d * q_stride, k, v, slot, out + d * H * HD, hs, L, HD, scale, g, ks, pb))
        continue;  /* keys in the lanes: the same arithmetic, the lanes all live */
      for (int64_t m0 = 0; m0 < hs[g + 1] - hs[g]; m0 += LANES)
        CAT(NAME, _chunk_task)(q + d * q_stride, k, v, slot, out + d * H * HD, hs, q_stride,
                               1, L - 1, H, HD, scale, g, m0, s, qt, kb);
    }
    free(s); free(qt); free(kb); free(slot); free(ks); free(pb);
  }
}

/* x += delta (rounded to T, skipped when delta is NULL);
   out = weight * T(x * rsqrt(mean x^2 + eps)): the rounding steps of HF's add and RMSNorm. */
void CAT(NAME, _add_rms_norm)(T *x, const T *delta, const T *w, T *out, int64_t rows, int64_t n,
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

#undef CAT_
#undef CAT
#undef NAME
#undef LD
#undef ST
#undef RT
#undef DOT
#undef QPACK
#undef QK
#undef PAIRS
#undef PV
#undef KTASK
#undef T
#undef SFX
