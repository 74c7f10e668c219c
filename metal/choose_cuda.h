// Helpers of choose.kernel (CUDA only): block-wide reductions in a fixed order, float keys that
// sort as their values do, and a bitonic sort in shared memory. A block's threads are whole warps.
#define SPR_FULL 0xffffffffu

// (value, index) pairs: the larger value, the lower index among equal values (MLX's argmax takes the
// first largest); an index < 0 is a thread that saw no element and loses to any that did
SPR_FN bool spr_beats(float v, int i, float bv, int bi) {
  return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

// The block's largest (value, index): butterflies in each warp, then the warps' results in warp
// order, read by every thread. red_f / red_i hold one entry a warp.
SPR_FN void spr_block_argmax(float& v, int& i, float* red_f, int* red_i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(SPR_FULL, v, o);
    const int oi = __shfl_xor_sync(SPR_FULL, i, o);
    if (spr_beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
  if (threadIdx.x % 32 == 0) {
    red_f[threadIdx.x / 32] = v;
    red_i[threadIdx.x / 32] = i;
  }
  __syncthreads();
  v = red_f[0];
  i = red_i[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) {
    if (spr_beats(red_f[w], red_i[w], v, i)) {
      v = red_f[w];
      i = red_i[w];
    }
  }
  __syncthreads();  // red_* may be written again right after
}

// A block-wide reduction in one order whatever the data: each lane's own value, the warp's
// butterfly, then the warps in warp order, read by every thread. red holds one entry a warp.
struct SprAdd {
  template <typename T>
  SPR_FN T operator()(T a, T b) const {
    return a + b;
  }
};
struct SprMin {
  SPR_FN float operator()(float a, float b) const { return fminf(a, b); }
};
template <typename T, typename Op>
SPR_FN T spr_block_reduce(T v, T* red, Op op) {
  for (int o = 16; o > 0; o >>= 1) {
    v = op(v, __shfl_xor_sync(SPR_FULL, v, o));
  }
  if (threadIdx.x % 32 == 0) {
    red[threadIdx.x / 32] = v;
  }
  __syncthreads();
  T s = red[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) {
    s = op(s, red[w]);
  }
  __syncthreads();  // red may be written again right after
  return s;
}
SPR_FN float spr_block_sum(float v, float* red_f) { return spr_block_reduce(v, red_f, SprAdd()); }
SPR_FN int spr_block_count(int v, int* red_i) { return spr_block_reduce(v, red_i, SprAdd()); }
SPR_FN float spr_block_min(float v, float* red_f) { return spr_block_reduce(v, red_f, SprMin()); }

// A float's bits as an unsigned that orders as the value does (-inf lowest, NaN past +inf).
SPR_FN unsigned spr_ordered(float x) {
  const unsigned u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
SPR_FN float spr_unordered(unsigned o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
// A key that sorts ascending as (value descending, index ascending).
SPR_FN unsigned long long spr_desc_key(float x, int i) {
  return (static_cast<unsigned long long>(~spr_ordered(x)) << 32) | static_cast<unsigned>(i);
}
SPR_FN float spr_key_value(unsigned long long key) { return spr_unordered(~static_cast<unsigned>(key >> 32)); }
SPR_FN int spr_key_index(unsigned long long key) { return static_cast<int>(key & 0xffffffffu); }

// Sorts a[0, P) ascending, P a power of two; every thread of the block takes part.
SPR_FN void spr_bitonic_sort(unsigned long long* a, int P) {
  for (int size = 2; size <= P; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int j = int(threadIdx.x); j < P / 2; j += int(blockDim.x)) {
        const int lo = 2 * stride * (j / stride) + j % stride;
        const int hi = lo + stride;
        const bool up = (lo & size) == 0;
        const unsigned long long A = a[lo], B = a[hi];
        if ((A > B) == up) {
          a[lo] = B;
          a[hi] = A;
        }
      }
      __syncthreads();
    }
  }
}

SPR_FN int spr_pow2_at_least(int n) {
  int p = 1;
  while (p < n) {
    p <<= 1;
  }
  return p;
}

// A logit with the request's bias and penalties, as engine/device_penalties.py's operations compute
// it in float32: x + bias, x - (frequency * count + (count > 0 ? presence : 0)), then the repetition
// penalty (x / r where x > 0, else x * r) on tokens of the prompt or the completion. Each step
// rounded once, as each of those operations is; neutral values (0, 1) change no bit.
SPR_FN float spr_adjusted(float x, float count, float bias, float in_prompt, const float* pens) {
  x = __fadd_rn(x, bias);
  x = __fsub_rn(x, __fadd_rn(__fmul_rn(pens[0], count), count > 0.0f ? pens[1] : 0.0f));
  if (in_prompt != 0.0f || count > 0.0f) {
    x = x > 0.0f ? __fdiv_rn(x, pens[2]) : __fmul_rn(x, pens[2]);
  }
  return x;
}
