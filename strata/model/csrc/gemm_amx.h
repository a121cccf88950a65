/* AMX matmuls over the tile layout of gemm.h, for the row counts where the vector kernels are
   compute-bound (a decode batch of 16+ rows, a prefill chunk).

   A packed record (16 columns x 32 input positions, 16 operands of 64 bytes) is exactly an AMX
   B tile of 16 rows x 64 bytes in the VNNI pairing that `tdpbf16ps` reads, so a bf16 weight
   feeds the tile unit as packed. A quantized tile is first decoded, all its records at once, to
   real bf16 weights (d * code + offset rounded to bf16: the one rounding this path adds over the
   vector kernel) into a per-thread buffer, then every 16-row slice of x multiplies it: one decode
   per weight per call, whatever M. x is copied to a zero-padded buffer of whole 16-row slices.
   Accumulation over K stays in the float32 C tiles.

   Linux hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM):
   gemm_amx_init() asks once and says whether the kernel may run. */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define STRATA_AMX 1
#define AMX_MT 2 /* 16-row slices of x per pass (C tiles 0 .. AMX_MT - 1) */

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config;

/* Tiles 0 .. AMX_MT - 1: C, AMX_MT .. 2 AMX_MT - 1: A (`rows` rows of x each: fewer than 16
   when the call has fewer, so the tile unit skips the padding), 2 AMX_MT: B (16 pairs of k). */
static void amx_configure(int rows) {
  amx_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 2 * AMX_MT + 1; t++) {
    cfg.rows[t] = t == 2 * AMX_MT ? 16 : (uint8_t)rows;
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
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                         1, 16, 0);
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
        _mm512_storeu_si512(out + (4 * g + o) * 32, _mm512_permutexvar_epi16(
            pairs, (__m512i)_mm512_cvtne2ps_pbh(wk1, wk)));
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

/* C tiles for `slices` (1 .. AMX_MT) 16-row slices of xp (row stride K) against nb B tiles at
   `w` (512 bf16 each), stored to acc (slices x 16 rows x 16 floats). */
static inline void amx_pass(int slices, const uint16_t *xp, int64_t K, const uint16_t *w,
                            int64_t nb, float *acc) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t b = 0; b < nb; b++) {
    _tile_loadd(4, w + b * 512, 64);
    _tile_loadd(2, xp + b * 32, K * 2);
    _tile_dpbf16ps(0, 2, 4);
    if (slices > 1) {
      _tile_loadd(3, xp + 16 * K + b * 32, K * 2);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  _tile_stored(0, acc, 64);
  if (slices > 1) _tile_stored(1, acc + 256, 64); }

/* out (M, N) bf16 = x (M, K) bf16 @ W^T + bias, W packed by gemm_pack_q (kind 1..3) or
   gemm_pack_bf16 (kind 0). Call only after gemm_amx_init() returned 1. */
void gemm_amx(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
              const uint16_t *bias, uint16_t *out) {
  const int64_t nb = K / QK, tiles = (N + TILE - 1) / TILE, rb = record_bytes(kind);
  const int64_t slices = (M + 15) / 16;
  uint16_t *xp = calloc((size_t)(slices * 16 * K), sizeof(uint16_t));
  memcpy(xp, x, sizeof(uint16_t) * (size_t)(M * K));
  #pragma omp parallel if (tiles > 1)
  {
    amx_configure(M < 16 ? (int)M : 16);
    uint16_t *dec = kind == KIND_BF16 ? NULL : aligned_alloc(64, (size_t)(nb * 1024));
    float *acc = aligned_alloc(64, sizeof(float) * 16 * 16 * AMX_MT);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const uint16_t *bt = (const uint16_t *)(w + t * nb * rb);
      if (dec) {
        if (kind == KIND_Q8_0) amx_decode_q8(w + t * nb * rb, nb, dec);
        else amx_decode_q4(kind, w + t * nb * rb, nb, dec);
        bt = dec;
      }
      for (int64_t s = 0; s < slices; s += AMX_MT) {
        const int n = slices - s < AMX_MT ? (int)(slices - s) : AMX_MT;
        amx_pass(n, xp + s * 16 * K, K, bt, nb, acc);
        const int64_t rows = M - s * 16 < 16 * n ? M - s * 16 : 16 * n;
        for (int64_t r = 0; r < rows; r++)
          for (int64_t c = 0; c < TILE && t * TILE + c < N; c++) {
            const int64_t col = t * TILE + c;
            st_bf16(out + (s * 16 + r) * N, col,
                    acc[r * TILE + c] + (bias ? ld_bf16(bias, col) : 0.f));
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
