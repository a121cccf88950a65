/* Strata's CPU kernels: paged decode attention, chunk attention and a fused residual-add +
   RMSNorm, for float32 and bfloat16 tensors; small-M matmuls over repacked bf16 and GGUF
   quantized weights (gemm.h); the checksum of KV payloads and the checked copy of a KV block
   (crc32.h).

   strata/model/kernel_build.py compiles this file at first use with the system C compiler
   (cc -O3 -march=native -fopenmp -fno-math-errno -shared -fPIC ... -lm) and loads it with
   ctypes; strata/model/cpu_kernels.py holds the Python wrappers. Each element type is one
   inclusion of dtype_kernels.h. */

#include "prelude.h"

#define T uint16_t
#define SFX bf16
#include "dtype_kernels.h"

#define T float
#define SFX f32
#include "dtype_kernels.h"

#include "gemm.h"
#include "gemm_amx.h"

#include "crc32.h"
