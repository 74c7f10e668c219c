// A lockstep SIMT machine for running the CUDA text of the kernel bodies on the CPU
// (tests/kernels/emulate.py, emulate_simt). Every thread of a block is a fiber (ucontext); blocks
// run one after another. Unlike the plain emulation (one-lane SIMD groups, threads one after
// another), 32-lane warps are real here: __shfl_xor_sync exchanges values between lanes,
// __syncthreads waits for the whole block, and the tensor-core MMA of qmm_mma is computed by the
// warp's 32 lanes together from the PTX fragment layout. So the cross-lane parts of a body (warp
// sums, shared-memory hand-overs, MMA fragments) execute too. Arithmetic is the CPU's: fp32 as
// IEEE, bf16 / fp16 rounded to nearest even; the MMA sums its 16 products in double, so its last
// bits need not match a GPU's.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cuda_common.h"  // metal/stub/: the qualifiers, types and math every stand-in shares

inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t both = uint64_t(x) | (uint64_t(y) << 32);
  unsigned out = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned pick = (s >> (4 * i)) & 7u;
    out |= unsigned((both >> (8 * pick)) & 0xFFu) << (8 * i);
  }
  return out;
}

// ---- the machine: fibers, barriers (one block runs at a time, so a function-static __shared__
// array is the running block's) ----
namespace simt {
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
};
struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = 0;
  unsigned block_arrived = 0, block_gen = 0;
  uint64_t progress = 0;  // arrivals and finished threads: a scheduler pass without any is a deadlock
  std::vector<unsigned> warp_arrived, warp_gen;
  std::vector<uint64_t> exchange;  // a value per thread for shuffles
  std::vector<float> mma;          // a warp's MMA fragments: per lane a0-a3, b0, b1 (as bits), c0-c3
};
inline Block*& block() {
  static Block* b = nullptr;
  return b;
}
inline void yield() {
  Block& b = *block();
  swapcontext(&b.fibers[b.current].ctx, &b.scheduler);
}
inline int warp_size(const Block& b, int warp) {
  return std::min<int>(32, int(b.fibers.size()) - warp * 32);
}
// every thread of the current thread's warp arrives before any goes on
inline void warp_sync() {
  Block& b = *block();
  const int w = b.current / 32;
  const unsigned gen = b.warp_gen[w];
  ++b.progress;
  if (++b.warp_arrived[w] == unsigned(warp_size(b, w))) {
    b.warp_arrived[w] = 0;
    ++b.warp_gen[w];
    return;
  }
  while (b.warp_gen[w] == gen) yield();
}
inline void block_sync() {
  Block& b = *block();
  const unsigned gen = b.block_gen;
  ++b.progress;
  if (++b.block_arrived == unsigned(b.fibers.size())) {
    b.block_arrived = 0;
    ++b.block_gen;
    return;
  }
  while (b.block_gen == gen) yield();
}
// v of lane src_lane of this warp (__shfl_sync), every lane of the warp taking part
template <typename T>
inline T shfl(T v, int src_lane) {
  static_assert(sizeof(T) <= 8, "a shuffled value fits 8 bytes");
  Block& b = *block();
  uint64_t word = 0;
  std::memcpy(&word, &v, sizeof v);
  b.exchange[b.current] = word;
  warp_sync();
  const int lane = b.current % 32;
  const int from = (b.current - lane) + (src_lane % 32);
  uint64_t got = b.exchange[std::min<int>(from, int(b.fibers.size()) - 1)];
  warp_sync();  // nobody overwrites the exchange before every lane has read it
  T out;
  std::memcpy(&out, &got, sizeof out);
  return out;
}
template <typename T>
inline T shfl_xor(T v, int mask) {
  return shfl(v, (block()->current % 32) ^ mask);
}

using Kernel = void (*)();
inline Kernel& kernel() {
  static Kernel k = nullptr;
  return k;
}
inline void trampoline() {
  kernel()();
  Block& b = *block();
  b.fibers[b.current].done = true;
  ++b.progress;
}
// runs kernel() for every thread of every block; blockIdx / threadIdx set before each resume
inline void launch(unsigned groups, unsigned threads, Kernel k, size_t stack_bytes = 256 * 1024) {
  kernel() = k;
  gridDim = {groups, 1u, 1u};
  blockDim = {threads, 1u, 1u};
  for (unsigned g = 0; g < groups; ++g) {
    Block b;
    b.fibers.resize(threads);
    const unsigned warps = (threads + 31) / 32;
    b.warp_arrived.assign(warps, 0);
    b.warp_gen.assign(warps, 0);
    b.exchange.assign(threads, 0);
    b.mma.assign(warps * 32 * 10, 0.0f);
    block() = &b;
    blockIdx = {g, 0u, 0u};
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = b.fibers[t];
      f.stack.resize(stack_bytes);
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.data();
      f.ctx.uc_stack.ss_size = f.stack.size();
      f.ctx.uc_link = &b.scheduler;
      makecontext(&f.ctx, trampoline, 0);
    }
    unsigned live = threads;
    while (live) {
      live = 0;
      const uint64_t before = b.progress;
      for (unsigned t = 0; t < threads; ++t) {
        if (b.fibers[t].done) continue;
        b.current = int(t);
        threadIdx = {t, 0u, 0u};
        swapcontext(&b.scheduler, &b.fibers[t].ctx);
        if (!b.fibers[t].done) ++live;
      }
      if (live && b.progress == before) {
        std::fprintf(stderr, "simt: deadlock in block %u: threads wait at a barrier others never reach\n", g);
        std::exit(3);
      }
    }
    block() = nullptr;
  }
}
}  // namespace simt

inline void __syncthreads() { simt::block_sync(); }
inline float __shfl_xor_sync(unsigned, float x, int m) { return simt::shfl_xor(x, m); }
inline unsigned __shfl_xor_sync(unsigned, unsigned x, int m) { return simt::shfl_xor(x, m); }
inline int __shfl_xor_sync(unsigned, int x, int m) { return simt::shfl_xor(x, m); }
inline unsigned __shfl_sync(unsigned, unsigned x, int src) { return simt::shfl(x, src); }
inline float __shfl_sync(unsigned, float x, int src) { return simt::shfl(x, src); }
#define SPR_SIMT 1

// ---- the tensor-core MMA of metal/qmm_mma_cuda.h (mma.sync.m16n8k16.row.col, fp32 accumulators) ----
#include <cuda_bf16.h>
#include <cuda_fp16.h>
namespace simt {
template <typename T>
inline float half_of(unsigned word, int hi) {
  T v;
  const unsigned short bits = static_cast<unsigned short>(hi ? word >> 16 : word & 0xFFFFu);
  std::memcpy(&v, &bits, 2);
  if constexpr (sizeof(T) == 2 && std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}
// d (this lane's c0..c3) += A [16 x 16] B [16 x 8]: the warp's 32 lanes hand over their fragments
// (lane = 4 g + t: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 =
// A[g+8][2t+8, 2t+9]; b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; c_i = C[g + 8 (i / 2)][2t + i % 2]),
// then each lane computes its four outputs
template <typename T>
inline void mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  Block& b = *block();
  const int lane = b.current % 32;
  unsigned* words = reinterpret_cast<unsigned*>(b.mma.data()) + (b.current - lane) * 10;
  const unsigned mine[6] = {a0, a1, a2, a3, b0, b1};
  std::memcpy(words + lane * 10, mine, sizeof mine);
  warp_sync();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const unsigned* f = words + l * 10;
    const int g = l / 4, t = l % 4;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = half_of<T>(f[0], h);
      A[g + 8][2 * t + h] = half_of<T>(f[1], h);
      A[g][2 * t + 8 + h] = half_of<T>(f[2], h);
      A[g + 8][2 * t + 8 + h] = half_of<T>(f[3], h);
      B[2 * t + h][g] = half_of<T>(f[4], h);
      B[2 * t + 8 + h][g] = half_of<T>(f[5], h);
    }
  }
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    double sum = 0.0;
    for (int k = 0; k < 16; ++k) sum += double(A[row][k]) * double(B[k][col]);
    d[i] = static_cast<float>(double(d[i]) + sum);
  }
  warp_sync();  // every lane has read the fragments before any lane's next MMA writes its own
}
}  // namespace simt
