// Spruce kernels, CUDA side of the shared-body scheme (metal/README.md). MLX's cuda_kernel
// compiles this header, then the generated signature, then the body, with NVRTC.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned int uint;  // Metal's name, used by the shared bodies

#ifndef SPR_SIMD
#define SPR_SIMD 32  // lanes of a SIMD group; a CPU emulation of the bodies sets 1 (tests/kernels)
#endif
#define SPR_FN __device__ __forceinline__
#define SPR_SHARED __shared__
#define SPR_TG
#define SPR_THREAD

SPR_FN float spr_simd_sum(float x) {
  for (int offset = SPR_SIMD / 2; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}
SPR_FN void spr_barrier() { __syncthreads(); }  // a threadgroup's threads meet; its memory is visible
SPR_FN float spr_fma(float a, float b, float c) { return fmaf(a, b, c); }
SPR_FN float spr_exp(float x) { return expf(x); }
SPR_FN float spr_log(float x) { return logf(x); }
SPR_FN float spr_rsqrt(float x) { return rsqrtf(x); }
SPR_FN float spr_sqrt(float x) { return sqrtf(x); }
SPR_FN float spr_neg_inf() { return __int_as_float(0xff800000); }
SPR_FN float spr_abs(float x) { return fabsf(x); }
SPR_FN float spr_max(float a, float b) { return fmaxf(a, b); }
SPR_FN float spr_to_float(float x) { return x; }
SPR_FN float spr_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
SPR_FN float spr_to_float(__half x) { return __half2float(x); }
