// Just enough of the Metal Shading Language for g++ to check the Metal build of the kernel
// bodies (names, types, template arguments) on machines without an Apple GPU. It checks syntax
// and names, nothing about Metal semantics or performance.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#define device
#define constant
#define threadgroup
#define thread

typedef unsigned int uint;
using std::min;
struct uint3 {
  uint x, y, z;
};
struct bfloat16_t {
  float v;
  bfloat16_t() = default;
  bfloat16_t(float f) : v(f) {}
  explicit operator float() const { return v; }
};
struct half {
  float v;
  half() = default;
  half(float f) : v(f) {}
  explicit operator float() const { return v; }
};
namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) {}
inline void simdgroup_barrier(mem_flags) {}
inline float simd_sum(float x) { return x; }
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float abs(float x) { return std::fabs(x); }
inline float max(float a, float b) { return a > b ? a : b; }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
}  // namespace metal
