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

static void amx_configure(void) {
  amx_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 2 * AMX_MT + 1; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg); }

int gemm_amx_init(void) {
  static int state = -1;
  if (state < 0) {
    /* ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 */
    state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }
  return state; }

/* The 16 records of tile `tile` (nb of them) decoded to bf16 B tiles in `dst` (nb x 512). */
static void amx_decode(int kind, const uint8_t *tile, int64_t nb, uint16_t *dst) {
  const int64_t rb = record_bytes(kind), cb = code_bytes(kind);
  const __m512i low4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi = _mm512_add_epi32(dup, _mm512_set1_epi32(8));
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *rec = tile + b * rb;
    uint16_t *out = dst + b * 512;
    /* per element e of an operand: column e / 2; lanes 0..15 are columns 0..7 */
    const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb)));
    __m512 off16 = _mm512_setzero_ps();
    if (kind == KIND_Q4_0) off16 = _mm512_mul_ps(d16, _mm512_set1_ps(-8.f));
    if (kind == KIND_Q4_1)
      off16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb + 32)));
    const __m512 dlo = _mm512_permutexvar_ps(dup, d16), dhi = _mm512_permutexvar_ps(dup_hi, d16);
    const __m512 olo = _mm512_permutexvar_ps(dup, off16);
    const __m512 ohi = _mm512_permutexvar_ps(dup_hi, off16);
    for (int g = 0; g < 4; g++) {
      __m512i codes[4]; /* 32 codes of operands 4g .. 4g + 3 as int16, element order */
      if (kind == KIND_Q8_0) {
        for (int o = 0; o < 4; o++)
          codes[o] = _mm512_cvtepi8_epi16(
              _mm256_loadu_si256((const __m256i *)(rec + (4 * g + o) * 32)));
      } else {
        const __m512i raw = _mm512_loadu_si512(rec + g * 64);
        const __m512i lo = _mm512_and_si512(raw, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        codes[0] = _mm512_unpacklo_epi8(lo, zero);
        codes[1] = _mm512_unpackhi_epi8(lo, zero);
        codes[2] = _mm512_unpacklo_epi8(hi, zero);
        codes[3] = _mm512_unpackhi_epi8(hi, zero);
      }
      for (int o = 0; o < 4; o++) {
        const __m512 a = _mm512_cvtepi32_ps(
            _mm512_cvtepi16_epi32(_mm512_castsi512_si256(codes[o])));
        const __m512 c = _mm512_cvtepi32_ps(
            _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(codes[o], 1)));
        const __m512 wlo = _mm512_fmadd_ps(a, dlo, olo), whi = _mm512_fmadd_ps(c, dhi, ohi);
        _mm512_storeu_si512(out + (4 * g + o) * 32, (__m512i)_mm512_cvtne2ps_pbh(whi, wlo));
      }
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
    amx_configure();
    uint16_t *dec = kind == KIND_BF16 ? NULL : aligned_alloc(64, (size_t)(nb * 1024));
    float *acc = aligned_alloc(64, sizeof(float) * 16 * 16 * AMX_MT);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const uint16_t *bt = (const uint16_t *)(w + t * nb * rb);
      if (dec) { amx_decode(kind, w + t * nb * rb, nb, dec); bt = dec; }
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
