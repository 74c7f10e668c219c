// Stub of CUDA's bfloat16 header for the g++ check (see ../cuda_stub.h).
#pragma once
struct __nv_bfloat16 {
  unsigned short bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : bits(static_cast<unsigned short>(f)) {}
};
inline float __bfloat162float(__nv_bfloat16 x) { return float(x.bits); }
