/* crc32 of zlib (the reflected polynomial 0xEDB88320), the checksum that ends every KV payload
   (strata/model/kv_codec.py), computed at memory speed.

   zlib's own crc32 runs at about 2.2 GB/s on the AMX Xeon; a 1,024-token prompt's KV (23.6 MB
   for SmolLM2) is checked three times on its way from a prefill instance to a decode instance
   (encoded, read, imported), 30 ms in all. Here the bytes are folded 64 at a time with
   carry-less multiplication (four independent 128-bit lanes, each multiplied forward by x^512
   and added to the next 64 bytes), the lanes folded into one, then reduced to 32 bits by
   Barrett reduction: the method of Gopal et al., "Fast CRC Computation for Generic Polynomials
   Using PCLMULQDQ Instruction" (Intel, 2009); the constants are x^k mod P for the fold
   distances and the polynomial's Barrett pair, bit-reflected. Lengths under 64 bytes, and the
   last len % 16 bytes, go a byte at a time through a table. Without PCLMULQDQ the table does
   everything (the Python side then prefers zlib).

   `state` is the running register, the complement of a zlib crc value: kv_crc32(p, n, crc)
   continues zlib.crc32(earlier bytes) == crc exactly as zlib.crc32(p, crc) would. */

#include <stdint.h>
#include <string.h>
#if defined(__PCLMUL__) && defined(__SSE4_1__)
#include <immintrin.h>
#define KV_CRC_FOLDS 1
#else
#define KV_CRC_FOLDS 0
#endif

static uint32_t crc_table[256];
static int crc_table_ready;

static void crc_table_init(void) {
    if (__atomic_load_n(&crc_table_ready, __ATOMIC_ACQUIRE)) return;
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
    __atomic_store_n(&crc_table_ready, 1, __ATOMIC_RELEASE);
}

static uint32_t crc_bytes(uint32_t state, const uint8_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) state = crc_table[(state ^ p[i]) & 0xFF] ^ (state >> 8);
    return state;
}

#if KV_CRC_FOLDS
/* One 128-bit lane multiplied forward by the distance whose constants `k` holds (low half for
   the lane's low 64 bits, high half for its high ones), plus `next`. */
static inline __m128i crc_fold16(__m128i lane, __m128i k, __m128i next) {
    __m128i lo = _mm_clmulepi64_si128(lane, k, 0x00);
    __m128i hi = _mm_clmulepi64_si128(lane, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* The register after `n` bytes (n >= 64, n % 16 == 0); with `dst`, the bytes are also stored
   there as they are loaded (one pass for a checked copy). */
static inline uint32_t crc_fold_copy(uint32_t state, const uint8_t *p, int64_t n, uint8_t *dst);

static uint32_t crc_fold(uint32_t state, const uint8_t *p, int64_t n) {
    return crc_fold_copy(state, p, n, NULL);
}

#define CRC_LOAD(q, off) _mm_loadu_si128((const __m128i *)((q) + (off)))
#define CRC_KEEP(v, off) do { if (dst) _mm_storeu_si128((__m128i *)(dst + (off)), v); } while (0)

static inline uint32_t crc_fold_copy(uint32_t state, const uint8_t *p, int64_t n, uint8_t *dst) {
    const __m128i by64 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);  /* x^(512+-32/+32) */
    const __m128i by16 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);  /* x^(128+-32/+32) */
    const __m128i by8 = _mm_set_epi64x(0, 0x0163cd6124LL);                  /* x^64 */
    const __m128i barrett = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL); /* mu, P */
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
    __m128i x1 = CRC_LOAD(p, 0), x2 = CRC_LOAD(p, 16), x3 = CRC_LOAD(p, 32), x4 = CRC_LOAD(p, 48);
    CRC_KEEP(x1, 0);
    CRC_KEEP(x2, 16);
    CRC_KEEP(x3, 32);
    CRC_KEEP(x4, 48);
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)state));
    p += 64;
    n -= 64;
    if (dst) dst += 64;
    for (; n >= 64; p += 64, n -= 64) {
        __m128i y1 = CRC_LOAD(p, 0), y2 = CRC_LOAD(p, 16), y3 = CRC_LOAD(p, 32),
                y4 = CRC_LOAD(p, 48);
        if (dst) {
            _mm_storeu_si128((__m128i *)(dst + 0), y1);
            _mm_storeu_si128((__m128i *)(dst + 16), y2);
            _mm_storeu_si128((__m128i *)(dst + 32), y3);
            _mm_storeu_si128((__m128i *)(dst + 48), y4);
            dst += 64;
        }
        x1 = crc_fold16(x1, by64, y1);
        x2 = crc_fold16(x2, by64, y2);
        x3 = crc_fold16(x3, by64, y3);
        x4 = crc_fold16(x4, by64, y4);
    }
    x1 = crc_fold16(x1, by16, x2);
    x1 = crc_fold16(x1, by16, x3);
    x1 = crc_fold16(x1, by16, x4);
    for (; n >= 16; p += 16, n -= 16) {
        __m128i y = CRC_LOAD(p, 0);
        if (dst) {
            _mm_storeu_si128((__m128i *)dst, y);
            dst += 16;
        }
        x1 = crc_fold16(x1, by16, y);
    }
    /* 128 bits to 64 */
    __m128i t = _mm_clmulepi64_si128(x1, by16, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), t);
    t = _mm_srli_si128(x1, 4);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, low32), by8, 0x00), t);
    /* 64 bits to 32: Barrett */
    t = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), barrett, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), barrett, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x1, t), 1);
}
#endif

static uint32_t crc_update(uint32_t state, const uint8_t *p, int64_t n) {
#if KV_CRC_FOLDS
    if (n >= 64) {
        int64_t folded = n & ~(int64_t)15;
        state = crc_fold(state, p, folded);
        p += folded;
        n -= folded;
    }
#endif
    return crc_bytes(state, p, n);
}

/* crc_update over the bytes of `src`, stored to `dst` on the way (one pass). */
static uint32_t crc_update_copy(uint32_t state, uint8_t *dst, const uint8_t *src, int64_t n) {
#if KV_CRC_FOLDS
    if (n >= 64) {
        int64_t folded = n & ~(int64_t)15;
        state = crc_fold_copy(state, src, folded, dst);
        src += folded;
        dst += folded;
        n -= folded;
    }
#endif
    memcpy(dst, src, (size_t)n);
    return crc_bytes(state, dst, n);
}

/* zlib.crc32(p[:n], crc) */
uint32_t kv_crc32(const uint8_t *p, int64_t n, uint32_t crc) {
    crc_table_init();
    return ~crc_update(~crc, p, n);
}

/* Whether kv_crc32 folds (1) or goes a byte at a time (0). */
int kv_crc32_folds(void) { return KV_CRC_FOLDS; }

/* Copies `num_runs` runs of `run` bytes, the i-th from src + i * src_stride to
   dst + i * dst_stride, and returns zlib.crc32 of the bytes copied, in order, continuing `crc`.
   Each run is summed as it is copied (the folds take the vectors the copy loaded). A block of
   the paged KV cache is such runs (one per layer and K/V), so a block leaves the cache, or
   enters it, checked in one pass. */
uint32_t kv_copy_crc32(uint8_t *dst, int64_t dst_stride, const uint8_t *src, int64_t src_stride,
                       int64_t run, int64_t num_runs, uint32_t crc) {
    crc_table_init();
    uint32_t state = ~crc;
    for (int64_t i = 0; i < num_runs; i++)
        state = crc_update_copy(state, dst + i * dst_stride, src + i * src_stride, run);
    return ~state;
}
