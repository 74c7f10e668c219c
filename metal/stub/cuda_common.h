// What every CPU stand-in for CUDA needs: the qualifiers as nothing, the index and vector types,
// the math functions, MLX's Shape / Strides. Included by cuda_stub.h (the g++ check) and by
// tests/kernels/simt/simt.h (the lockstep emulation), which add their own barriers and shuffles.
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
inline float __uint_as_float(unsigned x) {  // bit casts, as on the GPU: the emulations run them
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
// one block runs at a time in both stand-ins, and the lockstep one switches threads only at its
// barriers and shuffles: a plain read-modify-write is atomic there
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}
inline float __fadd_rn(float a, float b) { return a + b; }  // IEEE, round to nearest: the CPU's float
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float expf(float x) { return std::exp(x); }
inline float logf(float x) { return std::log(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float sqrtf(float x) { return std::sqrt(x); }
inline float fabsf(float x) { return std::fabs(x); }
inline float fmaxf(float a, float b) { return a > b ? a : b; }
inline float fminf(float a, float b) { return a < b ? a : b; }
inline float fmaf(float a, float b, float c) { return std::fma(a, b, c); }
using std::max;
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
