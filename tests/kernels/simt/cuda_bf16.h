// bfloat16 for the SIMT emulation (simt.h): real values, float -> bf16 rounded to nearest even.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

inline unsigned short simt_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16);
}
inline float simt_from_bf16(unsigned short b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
struct __nv_bfloat16 {
  unsigned short bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : bits(simt_to_bf16(f)) {}
};
inline float __bfloat162float(__nv_bfloat16 x) { return simt_from_bf16(x.bits); }
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(b)}; }
// double -> float rounded to odd: then float -> bf16 / fp16 to nearest even rounds the double
// once (the float keeps more than two extra bits)
inline float simt_round_to_odd(double r) {
  float f = static_cast<float>(r);
  if (double(f) == r || r != r || std::fabs(f) > 3.0e38f) return f;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::fabs(double(f)) > std::fabs(r)) u -= 1u;  // toward zero
  u |= 1u;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 simt_bf16_fma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  // one rounding, as the GPU's paired FMA: the product of two bf16 values is exact in double
  const double r = double(__bfloat162float(a)) * double(__bfloat162float(b)) + double(__bfloat162float(c));
  return __nv_bfloat16(simt_round_to_odd(r));
}
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return __nv_bfloat162{__nv_bfloat16(__bfloat162float(a.x) - __bfloat162float(b.x)),
                        __nv_bfloat16(__bfloat162float(a.y) - __bfloat162float(b.y))};
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return __nv_bfloat162{simt_bf16_fma(a.x, b.x, c.x), simt_bf16_fma(a.y, b.y, c.y)};
}
