// float16 for the SIMT emulation (simt.h): real values, float -> fp16 rounded to nearest even.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda_bf16.h"  // simt_round_to_odd

inline unsigned short simt_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const float a = std::fabs(f);
  if (std::isnan(f)) return static_cast<unsigned short>(sign | 0x7E00u);
  if (a >= 65520.0f) return static_cast<unsigned short>(sign | 0x7C00u);  // rounds to infinity
  if (a < 6.103515625e-05f) {  // subnormal: a multiple of 2^-24, rounded to nearest even
    const float q = std::nearbyint(a * 16777216.0f);
    return static_cast<unsigned short>(sign | static_cast<uint32_t>(q));
  }
  uint32_t v = u & 0x7FFFFFFFu;
  v += 0xFFFu + ((v >> 13) & 1u);  // round the 13 dropped bits to nearest even
  const uint32_t e = (v >> 23) - 112u;
  return static_cast<unsigned short>(sign | (e << 10) | ((v >> 13) & 0x3FFu));
}
inline float simt_from_half(unsigned short h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  float f;
  if (e == 0) {
    f = std::ldexp(float(m), -24);
  } else if (e == 31) {
    f = m ? NAN : INFINITY;
  } else {
    f = std::ldexp(float(m | 0x400u), int(e) - 25);
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= sign;
  std::memcpy(&f, &u, 4);
  return f;
}
struct __half {
  unsigned short bits;
  __half() = default;
  __half(float f) : bits(simt_to_half(f)) {}
};
inline float __half2float(__half x) { return simt_from_half(x.bits); }
struct __half2 {
  __half x, y;
};
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline __half simt_half_fma(__half a, __half b, __half c) {
  const double r = double(__half2float(a)) * double(__half2float(b)) + double(__half2float(c));
  return __half(simt_round_to_odd(r));
}
inline __half2 __hsub2(__half2 a, __half2 b) {
  return __half2{__half(__half2float(a.x) - __half2float(b.x)), __half(__half2float(a.y) - __half2float(b.y))};
}
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return __half2{simt_half_fma(a.x, b.x, c.x), simt_half_fma(a.y, b.y, c.y)};
}
