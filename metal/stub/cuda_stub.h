// Just enough of CUDA for g++ to check the CUDA build of the kernel bodies where nvcc is absent
// (CI). It checks syntax and names; the real compile is NVRTC's, on a GPU machine.
#pragma once
#include "cuda_common.h"

inline void __syncthreads() {}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) { return x ^ y ^ s; }
inline float __shfl_xor_sync(unsigned, float x, int) { return x; }
inline unsigned __shfl_xor_sync(unsigned, unsigned x, int) { return x; }
inline int __shfl_xor_sync(unsigned, int x, int) { return x; }
inline unsigned __shfl_sync(unsigned, unsigned x, int) { return x; }
