// Spruce kernels, Metal side of the shared-body scheme (metal/README.md). MLX's metal_kernel
// compiles its utilities (metal_stdlib, bfloat16_t), this header, the generated signature and
// the body.

#define SPR_SIMD 32  // lanes of a SIMD group on Apple GPUs
#define SPR_FN inline
#define SPR_SHARED threadgroup
#define SPR_TG threadgroup
#define SPR_THREAD thread

inline float spr_simd_sum(float x) { return metal::simd_sum(x); }
inline void spr_barrier() { metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup); }  // a threadgroup's threads meet
inline float spr_fma(float a, float b, float c) { return metal::fma(a, b, c); }
inline float spr_exp(float x) { return metal::exp(x); }
inline float spr_log(float x) { return metal::log(x); }
inline float spr_rsqrt(float x) { return metal::rsqrt(x); }
inline float spr_sqrt(float x) { return metal::sqrt(x); }
inline float spr_neg_inf() { return -INFINITY; }
inline float spr_abs(float x) { return metal::abs(x); }
inline float spr_max(float a, float b) { return metal::max(a, b); }
inline float spr_to_float(float x) { return x; }
inline float spr_to_float(bfloat16_t x) { return static_cast<float>(x); }
inline float spr_to_float(half x) { return static_cast<float>(x); }
