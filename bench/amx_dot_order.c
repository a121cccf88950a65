/* Which float32 arithmetic does AMX's TDPBF16PS perform? (issue 31, docs/benchmarks.md)

   A row computed on the AMX tiles is bit-identical to a row computed by the vector units only
   if the vector code can reproduce the tile's accumulation. This probe runs one tdpbf16ps
   (C += A . B over 16 pairs of bf16) on random tiles and compares each output with
   emulations: the two products of a pair added to C one after the other (even first, as the
   SDM's pseudo-code reads, or odd first, as VDPBF16PS does), the pair summed then added, one
   rounding over C + pair, and one rounding over C + all 32 products. Products of two bf16 are
   exact in float32, so only the additions' order and rounding can differ.

   cc -O2 -march=native -ffp-contract=off bench/amx_dot_order.c -o /tmp/amx_dot_order -lm
   /tmp/amx_dot_order            # needs AMX (Sapphire Rapids or later) and Linux >= 5.16 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

static float bf(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t to_bf(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }
static float spread(int e) { return ((float)rand() / (float)RAND_MAX - 0.5f) * ldexpf(1.f, rand() % e - e / 2); }

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) { puts("no AMX state granted"); return 1; }
  tilecfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 3; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  const char *names[] = {"sequential, even then odd", "sequential, odd then even (VDPBF16PS)",
                         "pair summed, then added", "one rounding over C + pair",
                         "one rounding over C + all 32 products"};
  long differ[5] = {0}, vdp = 0, total = 0;
  for (int it = 0; it < 1000; it++) {
    uint16_t A[16][32], B[16][32];
    float C0[16][16], C[16][16];
    for (int i = 0; i < 16; i++)
      for (int j = 0; j < 32; j++) { A[i][j] = to_bf(spread(12)); B[i][j] = to_bf(spread(12)); }
    for (int i = 0; i < 16; i++) for (int j = 0; j < 16; j++) C0[i][j] = spread(12);
    memcpy(C, C0, sizeof C);
    _tile_loadd(0, C, 64); _tile_loadd(1, A, 64); _tile_loadd(2, B, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, C, 64);
    for (int m = 0; m < 16; m++) {
      __m512 acc = _mm512_loadu_ps(C0[m]);
      for (int k = 0; k < 16; k++) {
        uint32_t pair; memcpy(&pair, &A[m][2 * k], 4);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)pair),
                               (__m512bh)_mm512_loadu_si512(B[k]));
      }
      float v[16]; _mm512_storeu_ps(v, acc);
      for (int n = 0; n < 16; n++) {
        volatile float e[4] = {C0[m][n], C0[m][n], C0[m][n], C0[m][n]};
        double all = C0[m][n];
        for (int k = 0; k < 16; k++) {
          const float p0 = bf(A[m][2 * k]) * bf(B[k][2 * n]);
          const float p1 = bf(A[m][2 * k + 1]) * bf(B[k][2 * n + 1]);
          e[0] = e[0] + p0; e[0] = e[0] + p1;
          e[1] = e[1] + p1; e[1] = e[1] + p0;
          const float pair = p0 + p1; e[2] = e[2] + pair;
          e[3] = (float)((double)e[3] + (double)p0 + (double)p1);
          all += (double)p0 + (double)p1;
        }
        const float r = C[m][n];
        for (int i = 0; i < 4; i++) differ[i] += r != e[i];
        differ[4] += r != (float)all;
        vdp += v[n] != C[m][n];
        total++;
      }
    }
  }
  printf("%ld outputs of TDPBF16PS; outputs that differ from each emulation:\n", total);
  for (int i = 0; i < 5; i++) printf("  %-40s %ld\n", names[i], differ[i]);
  printf("  %-40s %ld\n", "VDPBF16PS itself", vdp);
  return 0;
}
