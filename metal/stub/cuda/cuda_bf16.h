// Stub of CUDA's bfloat16 header for the g++ check (see ../cuda_stub.h).
#pragma once
struct __nv_bfloat16 {
  unsigned short bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : bits(static_cast<unsigned short>(f)) {}
};
inline float __bfloat162float(__nv_bfloat16 x) { return float(x.bits); }
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(b)}; }
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162) { return a; }
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162, __nv_bfloat162) { return a; }
