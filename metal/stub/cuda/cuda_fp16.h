// Stub of CUDA's half header for the g++ check (see ../cuda_stub.h).
#pragma once
struct __half {
  unsigned short bits;
  __half() = default;
  __half(float f) : bits(static_cast<unsigned short>(f)) {}
};
inline float __half2float(__half x) { return float(x.bits); }
struct __half2 {
  __half x, y;
};
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline __half2 __hsub2(__half2 a, __half2) { return a; }
inline __half2 __hfma2(__half2 a, __half2, __half2) { return a; }
