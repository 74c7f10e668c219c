// Just enough of CUDA for g++ to check the CUDA build of the kernel bodies where nvcc is absent
// (CI). It checks syntax and names; the real compile is NVRTC's, on a GPU machine.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__

struct dim3 {
  unsigned x, y, z;
};
extern dim3 blockIdx, threadIdx, blockDim, gridDim;
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline float __uint_as_float(unsigned x) { return static_cast<float>(x); }
inline void __syncthreads() {}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) { return x ^ y ^ s; }
inline float __shfl_xor_sync(unsigned, float x, int) { return x; }
inline unsigned __shfl_xor_sync(unsigned, unsigned x, int) { return x; }
inline float expf(float x) { return std::exp(x); }
inline float logf(float x) { return std::log(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float sqrtf(float x) { return std::sqrt(x); }
inline float __int_as_float(int x) {  // a bit cast, as on the GPU: the emulation runs it
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
inline float fabsf(float x) { return std::fabs(x); }
inline float fmaxf(float a, float b) { return a > b ? a : b; }
inline float fmaf(float a, float b, float c) { return std::fma(a, b, c); }
using std::min;
namespace cooperative_groups {}
struct Shape {  // MLX passes an input's shape by value when the body names `<input>_shape`
  int dims[8];
  int operator[](int i) const { return dims[i]; }
};
struct Strides {  // and its strides (elements) when it names `<input>_strides`
  int64_t dims[8];
  int64_t operator[](int i) const { return dims[i]; }
};
