// Stub of CUDA's bfloat16 header for the g++ check (see ../cuda_stub.h).
#pragma once
struct __nv_bfloat16 {
  unsigned short bits;
};
inline float __bfloat162float(__nv_bfloat16 x) { return float(x.bits); }
