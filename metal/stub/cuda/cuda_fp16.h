// Stub of CUDA's half header for the g++ check (see ../cuda_stub.h).
#pragma once
struct __half {
  unsigned short bits;
};
inline float __half2float(__half x) { return float(x.bits); }
