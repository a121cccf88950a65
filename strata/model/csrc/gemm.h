/* Weight-stationary small-M matmuls: out (M, N) = x (M, K) @ W^T (+ bias), x and out bf16.

   W is repacked once at load into tiles of 16 output columns. Within a tile, for every pair of
   input positions (k, k + 1) one 64-byte operand holds the 32 values
   [c0 k, c0 k+1, c1 k, c1 k+1, ..., c15 k+1]: the weight operand of one `vdpbf16ps`, whose other
   operand is the pair (x[r][k], x[r][k+1]) broadcast to 16 lanes. Each weight operand is loaded
   (or decoded) once and used for every row of a pass of MR rows, so the weights stream through
   the core once per pass, sequentially, and M rows cost little more than one.

   Layouts (a "record" is a tile of 16 columns x one block of 32 input positions):
     bf16   16 operands of 64 bytes per record (1,024 bytes), records in k order per tile.
     q8_0   16 operands of 32 int8 [c0 k, c0 k+1, ...] (512 bytes), then d[16] fp16.
     q4_0   256 bytes of nibbles (decode order below), then d[16] fp16.
     q4_1   the same, then d[16] fp16, then m[16] fp16.
   A q4 nibble v of column c is the unsigned code: w = d (v - 8) for q4_0, d v + m for q4_1.
   OR-ed under 0x4300 it is the bf16 number 128 + v, so a nibble becomes an operand with two
   instructions (an AND/shift and a byte unpack); the 128 is taken back once per record through
   the block's sum of x: w . x = d (128 + v) . x + (m - 128 d) sum(x) (q4_0: m = -8 d).
   Integer codes are exact in bf16, so within a block every product is exact in float32.

   N need not be a multiple of 16 (pack pads the last tile with zero columns); K must be a
   multiple of 32. Without AVX512-BF16 the quantized kernels run a portable loop over the same
   layout and the bf16 kernel is not built (gemm_has_bf16() == 0: the caller uses oneDNN). */

#define QK 32     /* input positions per block (GGUF's block size) */
#define TILE 16   /* output columns per tile */
#define MR_MAX 16 /* rows per pass */
enum { KIND_BF16 = 0, KIND_Q8_0 = 1, KIND_Q4_0 = 2, KIND_Q4_1 = 3 };

static inline float ld_f16(const uint16_t *p, int64_t i) {
  const uint32_t h = p[i], sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  uint32_t u;
  if (e == 0x1F) u = sign | 0x7F800000u | (m << 13);
  else if (e) u = sign | ((e + 112u) << 23) | (m << 13);
  else if (m == 0) u = sign;
  else { float f = (float)m * 5.9604644775390625e-8f; memcpy(&u, &f, 4); u |= sign; }
  float f; memcpy(&f, &u, 4); return f; }

/* Bytes of one record and of its codes (the rest is scales). */
static int64_t record_bytes(int kind) {
  switch (kind) {
    case KIND_BF16: return 1024;
    case KIND_Q8_0: return 512 + 32;
    case KIND_Q4_0: return 256 + 32;
    default: return 256 + 64;
  } }
static int64_t code_bytes(int kind) { return kind == KIND_Q8_0 ? 512 : kind == KIND_BF16 ? 1024 : 256; }

/* Byte offset, within a q4 record, and shift of the nibble of operand p, element e
   (column e / 2, position 2 p + e % 2). The decoder loads 64 bytes for operands 4g .. 4g + 3:
   low nibbles unpacked low/high per 128-bit lane give operands 4g, 4g + 1; high nibbles 4g + 2,
   4g + 3. */
static inline void q4_place(int64_t p, int64_t e, int64_t *byte, int *shift) {
  const int64_t g = p / 4, o = p % 4, lane = e / 8, i = e % 8;
  *byte = g * 64 + lane * 16 + (o & 1) * 8 + i;
  *shift = (o & 2) ? 4 : 0; }

/* ---- packing (runs once at load) ---- */

/* GGUF rows (N rows of K / 32 blocks each) -> tiles. Blocks: q8_0 {f16 d; i8 q[32]},
   q4_0 {f16 d; u8 q[16]}, q4_1 {f16 d; f16 m; u8 q[16]}; in q4 byte j holds positions j (low
   nibble) and j + 16 (high). */
void gemm_pack_q(int kind, const uint8_t *raw, int64_t N, int64_t K, uint8_t *dst) {
  const int64_t nb = K / QK, tiles = (N + TILE - 1) / TILE, rb = record_bytes(kind);
  const int64_t gb = kind == KIND_Q8_0 ? 34 : kind == KIND_Q4_0 ? 18 : 20;
  const int64_t cb = code_bytes(kind), hdr = kind == KIND_Q4_1 ? 4 : 2;
  memset(dst, 0, (size_t)(tiles * nb * rb));
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; t++)
    for (int64_t b = 0; b < nb; b++) {
      uint8_t *rec = dst + (t * nb + b) * rb;
      uint16_t *scales = (uint16_t *)(rec + cb);
      for (int64_t c = 0; c < TILE && t * TILE + c < N; c++) {
        const uint8_t *blk = raw + ((t * TILE + c) * nb + b) * gb;
        memcpy(scales + c, blk, 2);
        if (kind == KIND_Q4_1) memcpy(scales + TILE + c, blk + 2, 2);
        for (int64_t k = 0; k < QK; k++) {
          const int64_t p = k / 2, e = c * 2 + k % 2;
          if (kind == KIND_Q8_0) { rec[p * 32 + e] = blk[hdr + k]; continue; }
          const uint8_t v = k < 16 ? blk[hdr + k] & 0xF : blk[hdr + k - 16] >> 4;
          int64_t byte; int shift;
          q4_place(p, e, &byte, &shift);
          rec[byte] |= (uint8_t)(v << shift);
        }
      }
    } }

/* bf16 W (N, K) row-major -> tiles of 64-byte operands. */
void gemm_pack_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *dst) {
  const int64_t tiles = (N + TILE - 1) / TILE, pairs = K / 2;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; t++)
    for (int64_t p = 0; p < pairs; p++)
      for (int64_t e = 0; e < 32; e++) {
        const int64_t c = t * TILE + e / 2;
        dst[(t * pairs + p) * 32 + e] = c < N ? w[c * K + 2 * p + e % 2] : 0;
      } }

/* Integer code and (scale, offset) of element (column c of the tile, position k) of a record:
   w = d * code + off. Shared by the portable kernel and the embedding gather. */
static inline int code_of(int kind, const uint8_t *rec, int64_t c, int64_t k) {
  const int64_t p = k / 2, e = c * 2 + k % 2;
  if (kind == KIND_Q8_0) return (int8_t)rec[p * 32 + e];
  int64_t byte; int shift;
  q4_place(p, e, &byte, &shift);
  return (rec[byte] >> shift) & 0xF; }
static inline void scales_of(int kind, const uint8_t *rec, int64_t c, float *d, float *off) {
  const uint16_t *s = (const uint16_t *)(rec + code_bytes(kind));
  *d = ld_f16(s, c);
  *off = kind == KIND_Q4_0 ? -8.f * *d : kind == KIND_Q4_1 ? ld_f16(s, TILE + c) : 0.f; }

/* Rows `ids` of a packed quantized W, dequantized to bf16 (the embedding of a tied LM head). */
void gemm_rows_q(int kind, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids,
                 int64_t n, uint16_t *out) {
  const int64_t nb = K / QK, rb = record_bytes(kind);
  #pragma omp parallel for schedule(static) if (n > 4)
  for (int64_t i = 0; i < n; i++) {
    const int64_t row = ids[i], t = row / TILE, c = row % TILE;
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t *rec = w + (t * nb + b) * rb;
      float d, off;
      scales_of(kind, rec, c, &d, &off);
      for (int64_t k = 0; k < QK; k++)
        st_bf16(out + i * K, b * QK + k, d * (float)code_of(kind, rec, c, k) + off);
    }
  }
  (void)N; }

/* sum of each block of 32 x values per row: xs[r * nb + b] (float32 of the bf16 inputs). */
static void block_sums(const uint16_t *x, int64_t M, int64_t K, float *xs) {
  const int64_t nb = K / QK;
  for (int64_t r = 0; r < M; r++)
    for (int64_t b = 0; b < nb; b++) {
      float s = 0.f;
      for (int64_t k = 0; k < QK; k++) s += ld_bf16(x + r * K, b * QK + k);
      xs[r * nb + b] = s;
    } }

/* The portable kernel: one record decoded to floats (its codes), shared by all M rows. */
static void tile_q_portable(int kind, const uint16_t *x, const float *xs, int64_t M, int64_t K,
                            const uint8_t *tile, float *acc) {
  const int64_t nb = K / QK, rb = record_bytes(kind);
  float wq[QK][TILE], d[TILE], off[TILE];
  memset(acc, 0, sizeof(float) * (size_t)(M * TILE));
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *rec = tile + b * rb;
    for (int64_t c = 0; c < TILE; c++) {
      scales_of(kind, rec, c, d + c, off + c);
      for (int64_t k = 0; k < QK; k++) wq[k][c] = (float)code_of(kind, rec, c, k);
    }
    for (int64_t r = 0; r < M; r++) {
      float blk[TILE] = {0};
      for (int64_t k = 0; k < QK; k++) {
        const float xv = ld_bf16(x + r * K, b * QK + k);
        #pragma omp simd
        for (int64_t c = 0; c < TILE; c++) blk[c] += xv * wq[k][c];
      }
      const float s = xs[r * nb + b];
      #pragma omp simd
      for (int64_t c = 0; c < TILE; c++) acc[r * TILE + c] += d[c] * blk[c] + off[c] * s;
    }
  } }

/* acc (M x 16 floats) + bias -> out columns t*16 .. of the M rows (ldo = N). */
static inline void store_tile(const float *acc, int64_t M, int64_t t, int64_t N,
                              const uint16_t *bias, uint16_t *out) {
  for (int64_t r = 0; r < M; r++)
    for (int64_t c = 0; c < TILE && t * TILE + c < N; c++) {
      const int64_t col = t * TILE + c;
      st_bf16(out + r * N, col, acc[r * TILE + c] + (bias ? ld_bf16(bias, col) : 0.f));
    } }

#if defined(__AVX512BF16__)
/* One pass of MR rows over a q tile: per record, 16 weight operands decoded once and applied
   to every row; per record and row, the block's dot products are scaled into acc (MR x 16). */
static inline __attribute__((always_inline)) void pass_q(
    const int kind, const int MR, const uint32_t *x2, int64_t K2, const float *xs, int64_t nb,
    const uint8_t *tile, float *acc) {
  const int64_t rb = record_bytes(kind), cb = code_bytes(kind);
  const __m512i low4 = _mm512_set1_epi8(0x0F), hi43 = _mm512_set1_epi8(0x43);
  for (int r = 0; r < MR; r++) _mm512_storeu_ps(acc + r * TILE, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *rec = tile + b * rb;
    if (b + 1 < nb)
      for (int64_t c = 0; c < rb; c += 64) __builtin_prefetch(rec + rb + c);
    __m512 blk[MR_MAX];
    for (int r = 0; r < MR; r++) blk[r] = _mm512_setzero_ps();
    for (int g = 0; g < 4; g++) {  /* operands 4g .. 4g + 3 */
      __m512bh op[4];
      if (kind == KIND_Q8_0) {
        for (int o = 0; o < 4; o++) {
          const int8_t *q = (const int8_t *)rec + (4 * g + o) * 32;
          const __m512 lo = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
          const __m512 hi = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
          op[o] = _mm512_cvtne2ps_pbh(hi, lo);
        }
      } else {
        const __m512i raw = _mm512_loadu_si512(rec + g * 64);
        const __m512i lo = _mm512_and_si512(raw, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        op[0] = (__m512bh)_mm512_unpacklo_epi8(lo, hi43);
        op[1] = (__m512bh)_mm512_unpackhi_epi8(lo, hi43);
        op[2] = (__m512bh)_mm512_unpacklo_epi8(hi, hi43);
        op[3] = (__m512bh)_mm512_unpackhi_epi8(hi, hi43);
      }
      for (int o = 0; o < 4; o++) {
        const int64_t pair = b * (QK / 2) + 4 * g + o;
        for (int r = 0; r < MR; r++)
          blk[r] = _mm512_dpbf16_ps(blk[r], (__m512bh)_mm512_set1_epi32((int)x2[r * K2 + pair]),
                                    op[o]);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb)));
    __m512 off = _mm512_setzero_ps();
    if (kind == KIND_Q4_0) off = _mm512_mul_ps(d, _mm512_set1_ps(-136.f));
    if (kind == KIND_Q4_1)
      off = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f),
                             _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb + 32))));
    for (int r = 0; r < MR; r++) {
      __m512 t = _mm512_fmadd_ps(blk[r], d, _mm512_loadu_ps(acc + r * TILE));
      if (kind != KIND_Q8_0) t = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * nb + b]), off, t);
      _mm512_storeu_ps(acc + r * TILE, t);
    }
  } }

/* One pass of MR rows over NT adjacent bf16 tiles (NT x MR independent sums). */
static inline __attribute__((always_inline)) void pass_bf16(
    const int MR, const int NT, const uint32_t *x2, int64_t K2, const uint16_t *tile,
    int64_t tile_elems, float *acc) {
  __m512 a[4][MR_MAX];
  for (int n = 0; n < NT; n++)
    for (int r = 0; r < MR; r++) a[n][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; p++) {
    for (int n = 0; n < NT; n++) {
      const uint16_t *op = tile + n * tile_elems + p * 32;
      __builtin_prefetch(op + 32 * 16);
      const __m512bh w = (__m512bh)_mm512_loadu_si512(op);
      for (int r = 0; r < MR; r++)
        a[n][r] = _mm512_dpbf16_ps(a[n][r], (__m512bh)_mm512_set1_epi32((int)x2[r * K2 + p]), w);
    }
  }
  for (int n = 0; n < NT; n++)
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(acc + (n * MR_MAX + r) * TILE, a[n][r]); }

/* Rows are taken in passes of 16, 8, 4, 2, 1 (few specialised bodies: the library compiles at
   every start); a weight tile re-read for a second pass comes from L1/L2, not memory. */
static inline int64_t pass_rows(int64_t left) {
  return left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1; }

static void tile_q(int kind, const uint16_t *x, const float *xs, int64_t M, int64_t K,
                   const uint8_t *tile, float *acc) {
  const int64_t nb = K / QK, K2 = K / 2;
  for (int64_t r0 = 0; r0 < M;) {
    const int64_t mr = pass_rows(M - r0);
    const uint32_t *x2 = (const uint32_t *)x + r0 * K2;
    const float *xr = xs + r0 * nb;
    float *ar = acc + r0 * TILE;
#define QPASS(R) do { \
      if (kind == KIND_Q8_0) pass_q(KIND_Q8_0, R, x2, K2, xr, nb, tile, ar); \
      else if (kind == KIND_Q4_0) pass_q(KIND_Q4_0, R, x2, K2, xr, nb, tile, ar); \
      else pass_q(KIND_Q4_1, R, x2, K2, xr, nb, tile, ar); } while (0)
    if (mr == 16) QPASS(16); else if (mr == 8) QPASS(8); else if (mr == 4) QPASS(4);
    else if (mr == 2) QPASS(2); else QPASS(1);
#undef QPASS
    r0 += mr;
  } }
#endif

int gemm_has_bf16(void) {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

/* out (M, N) bf16 = x (M, K) bf16 @ W^T + bias (bias: N bf16 or NULL); W packed by
   gemm_pack_q. OpenMP over tiles: each thread streams a contiguous run of the weights. */
void gemm_q(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
            const uint16_t *bias, uint16_t *out) {
  const int64_t nb = K / QK, tiles = (N + TILE - 1) / TILE, rb = record_bytes(kind);
  float *xs = malloc(sizeof(float) * (size_t)(M * nb));
  block_sums(x, M, K, xs);
  #pragma omp parallel if (tiles > 1)
  {
    float *acc = malloc(sizeof(float) * (size_t)(M * TILE));
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const uint8_t *tile = w + t * nb * rb;
#if defined(__AVX512BF16__)
      tile_q(kind, x, xs, M, K, tile, acc);
#else
      tile_q_portable(kind, x, xs, M, K, tile, acc);
#endif
      store_tile(acc, M, t, N, bias, out);
    }
    free(acc);
  }
  free(xs); }

/* The portable kernel on any build, for tests of the layout against the vector kernel. */
void gemm_q_portable(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w,
                     int64_t N, const uint16_t *bias, uint16_t *out) {
  const int64_t nb = K / QK, tiles = (N + TILE - 1) / TILE, rb = record_bytes(kind);
  float *xs = malloc(sizeof(float) * (size_t)(M * nb));
  float *acc = malloc(sizeof(float) * (size_t)(M * TILE));
  block_sums(x, M, K, xs);
  for (int64_t t = 0; t < tiles; t++) {
    tile_q_portable(kind, x, xs, M, K, w + t * nb * rb, acc);
    store_tile(acc, M, t, N, bias, out);
  }
  free(acc); free(xs); }

/* out (M, N) bf16 = x (M, K) bf16 @ W^T + bias; W packed by gemm_pack_bf16. Only where
   gemm_has_bf16(). */
void gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
               const uint16_t *bias, uint16_t *out) {
#if defined(__AVX512BF16__)
  const int64_t tiles = (N + TILE - 1) / TILE, K2 = K / 2, tile_elems = K2 * 32;
  /* Few rows: several tiles per task for independent sums; more rows: one tile, wide passes. */
  const int NT = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  const int64_t tasks = (tiles + NT - 1) / NT;
  #pragma omp parallel if (tasks > 1)
  {
    float *acc = malloc(sizeof(float) * (size_t)((M > 4 * MR_MAX ? M : 4 * MR_MAX) * TILE));
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
      const int64_t t0 = task * NT, nt = tiles - t0 < NT ? tiles - t0 : NT;
      const uint16_t *tile = w + t0 * tile_elems;
      const uint32_t *x2 = (const uint32_t *)x;
      if (NT > 1 && nt == NT) {
        if (NT == 4 && M == 1) pass_bf16(1, 4, x2, K2, tile, tile_elems, acc);
        else if (NT == 4) pass_bf16(2, 4, x2, K2, tile, tile_elems, acc);
        else if (M == 3) pass_bf16(3, 2, x2, K2, tile, tile_elems, acc);
        else pass_bf16(4, 2, x2, K2, tile, tile_elems, acc);
        for (int64_t n = 0; n < nt; n++)
          store_tile(acc + n * MR_MAX * TILE, M, t0 + n, N, bias, out);
        continue;
      }
      for (int64_t n = 0; n < nt; n++) {
        const uint16_t *tn = tile + n * tile_elems;
        for (int64_t r0 = 0; r0 < M;) {
          const int64_t mr = pass_rows(M - r0);
          const uint32_t *xr = x2 + r0 * K2;
          float *ar = acc + r0 * TILE;
          if (mr == 16) pass_bf16(16, 1, xr, K2, tn, tile_elems, ar);
          else if (mr == 8) pass_bf16(8, 1, xr, K2, tn, tile_elems, ar);
          else if (mr == 4) pass_bf16(4, 1, xr, K2, tn, tile_elems, ar);
          else if (mr == 2) pass_bf16(2, 1, xr, K2, tn, tile_elems, ar);
          else pass_bf16(1, 1, xr, K2, tn, tile_elems, ar);
          r0 += mr;
        }
        store_tile(acc, M, t0 + n, N, bias, out);
      }
    }
    free(acc);
  }
#else
  (void)x; (void)M; (void)K; (void)w; (void)N; (void)bias; (void)out;
#endif
}
