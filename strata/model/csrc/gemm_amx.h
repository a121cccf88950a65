/* AMX matmuls over the tile layout of gemm.h, for the row counts where they beat the vector
   kernels (gemm.AMX_MIN_ROWS: from 2 rows for bf16 weights, 3 for quantized; every row count
   under `strata serve --deterministic`).

   A packed record (16 columns x 32 input positions, 16 operands of 64 bytes) is exactly an AMX
   B tile of 16 rows x 64 bytes in the VNNI pairing that `tdpbf16ps` reads, so a bf16 weight
   feeds the tile unit as packed. A quantized column tile is first decoded, all its records at
   once, to real bf16 weights (d * code + offset rounded to bf16: the one rounding this path adds
   over the vector kernel) into a per-thread buffer, then every 16-row slice of x multiplies it:
   one decode per weight per call, whatever M. A thread takes column tiles two at a time and row
   slices two at a time (four C tiles). x is copied to a zero-padded buffer of whole 16-row
   slices. Accumulation over K stays in the float32 C tiles, in k order whatever the blocking.

   Linux hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM):
   gemm_amx_init() asks once and says whether the kernel may run. */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define STRATA_AMX 1

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config;

/* Tiles 0-3: C (row slice s of column tile c at 2 c + s), 4-5: A (a 16-row slice of x each,
   `rows` rows: fewer than 16 when the call has fewer, so the tile unit skips the padding), 6-7: B
   (a column tile's record each: 16 pairs of k). */
static void amx_configure(int rows) {
  amx_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = t >= 6 ? 16 : (uint8_t)rows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg); }

int gemm_amx_init(void) {
  static int state = -1;
  if (state < 0) {
    /* ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 */
    state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }
  return state; }

/* Decoding a quantized tile (nb records) to bf16 B tiles in `dst` (nb x 512): the one rounding
   this path adds over the vector kernel, w = bf16(d * code + offset), the same bits at every M.
   q4_0 / q4_1: a nibble OR-ed under 0x4300 is the bf16 number 128 + v (as in gemm.h); as a
   32-bit lane i (column i, inputs k and k + 1) its float32 values are one shift (k) and one AND
   (k + 1) away, so w = (128 + v) d + (m - 128 d) (q4_0: m = -8 d) is one fma per 16 columns
   with d and m as loaded; the two halves are rounded together and interleaved back to pairs.
   q8_0: the codes widened in element order (element e: column e / 2), d spread to match. */
static void amx_decode_q4(int kind, const uint8_t *tile, int64_t nb, uint16_t *dst) {
  const int64_t rb = record_bytes(kind), cb = code_bytes(kind);
  const __m512i low4 = _mm512_set1_epi8(0x0F), hi43 = _mm512_set1_epi8(0x43);
  const __m512i odd = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *rec = tile + b * rb;
    uint16_t *out = dst + b * 512;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb)));
    const __m512 off = kind == KIND_Q4_0
        ? _mm512_mul_ps(d, _mm512_set1_ps(-136.f))
        : _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f), _mm512_cvtph_ps(
              _mm256_loadu_si256((const __m256i *)(rec + cb + 32))));
    for (int g = 0; g < 4; g++) {  /* operands 4g .. 4g + 3 */
      const __m512i raw = _mm512_loadu_si512(rec + g * 64);
      const __m512i lo = _mm512_and_si512(raw, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      const __m512i op[4] = {_mm512_unpacklo_epi8(lo, hi43), _mm512_unpackhi_epi8(lo, hi43),
                             _mm512_unpacklo_epi8(hi, hi43), _mm512_unpackhi_epi8(hi, hi43)};
      for (int o = 0; o < 4; o++) {
        const __m512 wk = _mm512_fmadd_ps(
            _mm512_castsi512_ps(_mm512_slli_epi32(op[o], 16)), d, off);
        const __m512 wk1 = _mm512_fmadd_ps(
            _mm512_castsi512_ps(_mm512_and_si512(op[o], odd)), d, off);
        _mm512_storeu_si512(out + (4 * g + o) * 32,
                            pair_halves((__m512i)_mm512_cvtne2ps_pbh(wk1, wk)));
      }
    }
  } }

static void amx_decode_q8(const uint8_t *tile, int64_t nb, uint16_t *dst) {
  const int64_t rb = record_bytes(KIND_Q8_0), cb = code_bytes(KIND_Q8_0);
  const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi = _mm512_add_epi32(dup, _mm512_set1_epi32(8));
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *rec = tile + b * rb;
    uint16_t *out = dst + b * 512;
    const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb)));
    const __m512 dlo = _mm512_permutexvar_ps(dup, d16), dhi = _mm512_permutexvar_ps(dup_hi, d16);
    for (int o = 0; o < 16; o++) {
      const int8_t *q = (const int8_t *)rec + o * 32;
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
      const __m512 c = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
      _mm512_storeu_si512(out + o * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(c, dhi),
                                                                     _mm512_mul_ps(a, dlo)));
    }
  } }

/* C tiles of `slices` (1, 2) 16-row slices of xp (row stride K) by `cols` (1, 2) column tiles
   (nb B tiles of 512 bf16 each at w0, w1): two A and two B loads feed four products. Each C
   element sums its k in order whatever the blocking, so a row's result never depends on M.
   Stored to acc + 256 (2 c + s), 16 x 16 floats each. */
static inline void amx_pass(int slices, int cols, const uint16_t *xp, int64_t K,
                            const uint16_t *w0, const uint16_t *w1, int64_t nb, float *acc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t b = 0; b < nb; b++) {
    _tile_loadd(6, w0 + b * 512, 64);
    _tile_loadd(4, xp + b * 32, K * 2);
    _tile_dpbf16ps(0, 4, 6);
    if (slices > 1) {
      _tile_loadd(5, xp + 16 * K + b * 32, K * 2);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (cols > 1) {
      _tile_loadd(7, w1 + b * 512, 64);
      _tile_dpbf16ps(2, 4, 7);
      if (slices > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 64);
  if (slices > 1) _tile_stored(1, acc + 256, 64);
  if (cols > 1) {
    _tile_stored(2, acc + 512, 64);
    if (slices > 1) _tile_stored(3, acc + 768, 64);
  } }

/* `rows` rows of a C tile (16 floats each) + bias, rounded to bf16 (nearest even, as st_bf16)
   into out's columns t * 16 .. (fewer at N's edge). */
static inline void amx_store(const float *acc, int64_t rows, int64_t t, int64_t N,
                             const uint16_t *bias, uint16_t *out) {
  const int64_t left = N - t * TILE;
  const __mmask16 cols = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
  __m512 b = _mm512_setzero_ps();
  if (bias)
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm256_maskz_loadu_epi16(cols, bias + t * TILE)), 16));
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  for (int64_t r = 0; r < rows; r++) {
    const __m512i u = _mm512_castps_si512(_mm512_add_ps(_mm512_loadu_ps(acc + r * TILE), b));
    const __m512i even = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, even)),
                                              16);
    _mm256_mask_storeu_epi16(out + r * N + t * TILE, cols, _mm512_cvtepi32_epi16(rounded));
  } }

/* out (M, N) bf16 = x (M, K) bf16 @ W^T + bias, W packed by gemm_pack_q (kind 1..3) or
   gemm_pack_bf16 (kind 0). Call only after gemm_amx_init() returned 1. */
void gemm_amx(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
              const uint16_t *bias, uint16_t *out) {
  const int64_t nb = K / QK, tiles = (N + TILE - 1) / TILE, rb = record_bytes(kind);
  const int64_t slices = (M + 15) / 16;
  uint16_t *xp = calloc((size_t)(slices * 16 * K), sizeof(uint16_t));
  memcpy(xp, x, sizeof(uint16_t) * (size_t)(M * K));
  const int64_t pairs = (tiles + 1) / 2;  /* column tiles two at a time */
  #pragma omp parallel if (pairs > 1)
  {
    amx_configure(M < 16 ? (int)M : 16);
    uint16_t *dec = kind == KIND_BF16 ? NULL : aligned_alloc(64, (size_t)(2 * nb * 1024));
    float *acc = aligned_alloc(64, sizeof(float) * 16 * 16 * 4);
    #pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
      const int64_t t0 = 2 * p;
      const int cols = tiles - t0 < 2 ? 1 : 2;
      const uint16_t *bt[2];
      for (int c = 0; c < cols; c++) {
        const uint8_t *tile = w + (t0 + c) * nb * rb;
        bt[c] = (const uint16_t *)tile;
        if (dec) {
          uint16_t *into = dec + c * nb * 512;
          if (kind == KIND_Q8_0) amx_decode_q8(tile, nb, into);
          else amx_decode_q4(kind, tile, nb, into);
          bt[c] = into;
        }
      }
      for (int64_t s = 0; s < slices; s += 2) {
        const int n = slices - s < 2 ? 1 : 2;
        amx_pass(n, cols, xp + s * 16 * K, K, bt[0], bt[cols - 1], nb, acc);
        for (int c = 0; c < cols; c++)
          for (int i = 0; i < n; i++) {
            const int64_t row0 = (s + i) * 16, rows = M - row0 < 16 ? M - row0 : 16;
            amx_store(acc + 256 * (2 * c + i), rows, t0 + c, N, bias, out + row0 * N);
          }
      }
    }
    free(acc);
    free(dec);
    _tile_release();
  }
  free(xp); }
#else
int gemm_amx_init(void) { return 0; }
void gemm_amx(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
              const uint16_t *bias, uint16_t *out) {
  (void)kind; (void)x; (void)M; (void)K; (void)w; (void)N; (void)bias; (void)out; }
#endif
