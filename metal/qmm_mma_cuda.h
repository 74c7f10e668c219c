// Helpers of qmm_mma.kernel, CUDA only: the tensor-core MMA (m16n8k16, fp32 accumulators) and
// packing two floats into the register pair of the activation type. Under NVRTC (__CUDACC__)
// they are PTX; elsewhere (the g++ check against metal/stub/) a scalar stand-in with the same
// signature, so the body's names and types are still checked.

template <typename T>
SPR_FN uint spr_pack2(float lo, float hi);

template <>
SPR_FN uint spr_pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half, as the MMA wants
  return *reinterpret_cast<uint*>(&v);
}

template <>
SPR_FN uint spr_pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint*>(&v);
}

// d += A [16 x 16] (a0..a3) x B [16 x 8] (b0, b1), fragments as in PTX's mma.m16n8k16 with .row.col
template <typename T>
SPR_FN void spr_mma(float* d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1);

#if defined(__CUDACC__)
// one specialisation per activation type; only the PTX type name differs
#define SPR_MMA_FOR(T, PTX_TYPE)                                                                  \
  template <>                                                                                    \
  SPR_FN void spr_mma<T>(float* d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1) {       \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 "          \
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                       \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                        \
  }
SPR_MMA_FOR(__nv_bfloat16, "bf16")
SPR_MMA_FOR(__half, "f16")
#undef SPR_MMA_FOR
#else
template <typename T>
SPR_FN void spr_mma(float* d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1) {
  d[0] += float(a0 ^ b0);  // syntax stand-in for the g++ check; never executed
  d[1] += float(a1 ^ b1);
  d[2] += float(a2);
  d[3] += float(a3);
}
#endif

// word i (0..3) of a 16-byte load; i is a constant once the loops are unrolled
SPR_FN uint spr_word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// value idx of a 16-byte load of packed BITS-bit weights, dequantized: scale * q + bias. The
// integer becomes a float through the exponent trick (2^23 + q, minus 2^23: exact, full rate).
template <int BITS>
SPR_FN float spr_dequant(const uint4& v, int idx, float scale, float bias) {
  constexpr int PER = 32 / BITS;
  const uint q = (spr_word(v, idx / PER) >> (BITS * (idx % PER))) & ((1u << BITS) - 1u);
  return fmaf(scale, __uint_as_float(0x4B000000u | q) - 8388608.0f, bias);
}

// Values i and i + 4 (i = 0..3) of a word of eight 4-bit weights, dequantized as a pair of the
// activation type (scale2, bias2: the group's scale and bias, each in both halves). See DQ in
// qmm_mma.kernel; the subtraction is exact, the FMA rounds once.
template <typename T>
SPR_FN uint spr_dequant_pair4(uint w, int i, uint scale2, uint bias2);

// one specialisation per activation type; only the pair type and the offset differ (the offset
// is a float of the type whose last mantissa bit is worth 1: bf16 128, fp16 1024)
#define SPR_DEQUANT_PAIR4_FOR(T, PAIR, OFFSET)                                                  \
  template <>                                                                                    \
  SPR_FN uint spr_dequant_pair4<T>(uint w, int i, uint scale2, uint bias2) {                     \
    uint m = ((w >> (4 * i)) & 0x000F000Fu) | OFFSET; /* OFFSET + q in each half */              \
    const uint off = OFFSET;                                                                     \
    PAIR q = __hsub2(*reinterpret_cast<PAIR*>(&m), *reinterpret_cast<const PAIR*>(&off));        \
    PAIR d = __hfma2(q, *reinterpret_cast<PAIR*>(&scale2), *reinterpret_cast<PAIR*>(&bias2));    \
    return *reinterpret_cast<uint*>(&d);                                                         \
  }
SPR_DEQUANT_PAIR4_FOR(__nv_bfloat16, __nv_bfloat162, 0x43004300u)
SPR_DEQUANT_PAIR4_FOR(__half, __half2, 0x64006400u)
#undef SPR_DEQUANT_PAIR4_FOR

// Deferred scales (DQ = 2 in qmm_mma.kernel). Nibbles i and i + 4 (i = 0..3) of a word of eight
// 4-bit weights as a pair of the activation type worth OFFSET + q each, exact: the mask-and-or
// of the paired form without its subtraction and FMA (the scale is applied to the group's sum).
// off2: spr_offset2 in a register the compiler cannot fold (see the kernel), so that the
// mask-and-or is one LOP3: with both constants as immediates ptxas splits it in two (a LOP3 takes
// one immediate).
SPR_FN uint spr_raw_pair4(uint w, int i, uint off2) { return ((w >> (4 * i)) & 0x000F000Fu) | off2; }

// the offset spr_raw_pair4 adds (a float of the type whose last mantissa bit is worth 1), the
// same in both halves of a pair, and a pair of ones (the A of the MMA that sums a group's activations)
template <typename T>
SPR_FN float spr_pair_offset();
template <>
SPR_FN float spr_pair_offset<__nv_bfloat16>() { return 128.0f; }
template <>
SPR_FN float spr_pair_offset<__half>() { return 1024.0f; }
template <typename T>
SPR_FN uint spr_offset2();
template <>
SPR_FN uint spr_offset2<__nv_bfloat16>() { return 0x43004300u; }
template <>
SPR_FN uint spr_offset2<__half>() { return 0x64006400u; }
template <typename T>
SPR_FN uint spr_one2();
template <>
SPR_FN uint spr_one2<__nv_bfloat16>() { return 0x3F803F80u; }
template <>
SPR_FN uint spr_one2<__half>() { return 0x3C003C00u; }

// A lane's share of one step (16 words = 128 4-bit inputs) of a weight row: WPL words of each of
// the step's 4 / WPL groups, those of lane t, group by group. WPL = 4 is one 16-byte load.
template <int WPL>
SPR_FN uint4 spr_lane_words(const uint* step, uint t);
template <>
SPR_FN uint4 spr_lane_words<4>(const uint* step, uint t) { return *reinterpret_cast<const uint4*>(step + 4 * t); }
template <>
SPR_FN uint4 spr_lane_words<2>(const uint* step, uint t) {
  const uint2 a = *reinterpret_cast<const uint2*>(step + 2 * t);
  const uint2 b = *reinterpret_cast<const uint2*>(step + 8 + 2 * t);
  return make_uint4(a.x, a.y, b.x, b.y);
}
template <>
SPR_FN uint4 spr_lane_words<1>(const uint* step, uint t) {
  return make_uint4(step[t], step[4 + t], step[8 + t], step[12 + t]);
}

// N (1, 2 or 4) consecutive 16-bit values, packed low half first: one register for up to two (a
// register a row saved keeps the one-row build at 64 registers, two blocks of 512 threads an SM)
template <int N>
struct spr_halves {
  using type = uint;
};
template <>
struct spr_halves<4> {
  using type = uint2;
};

// one load of N values from p (aligned to N values: the step's groups of a row start at a
// multiple of N)
template <int N, typename T>
SPR_FN typename spr_halves<N>::type spr_load_halves(const T* p);
template <>
SPR_FN uint spr_load_halves<1, __nv_bfloat16>(const __nv_bfloat16* p) {
  return uint(*reinterpret_cast<const unsigned short*>(p));
}
template <>
SPR_FN uint spr_load_halves<1, __half>(const __half* p) { return uint(*reinterpret_cast<const unsigned short*>(p)); }
template <>
SPR_FN uint spr_load_halves<2, __nv_bfloat16>(const __nv_bfloat16* p) { return *reinterpret_cast<const uint*>(p); }
template <>
SPR_FN uint spr_load_halves<2, __half>(const __half* p) { return *reinterpret_cast<const uint*>(p); }
template <>
SPR_FN uint2 spr_load_halves<4, __nv_bfloat16>(const __nv_bfloat16* p) { return *reinterpret_cast<const uint2*>(p); }
template <>
SPR_FN uint2 spr_load_halves<4, __half>(const __half* p) { return *reinterpret_cast<const uint2*>(p); }

// value i of spr_load_halves' result as a float
template <typename T>
SPR_FN float spr_half_to_float(uint v, int i);
template <>
SPR_FN float spr_half_to_float<__nv_bfloat16>(uint v, int i) { return __uint_as_float(i % 2 ? v & 0xFFFF0000u : v << 16); }
template <>
SPR_FN float spr_half_to_float<__half>(uint v, int i) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(i % 2 ? v >> 16 : v & 0xFFFFu)));
}
template <typename T>
SPR_FN float spr_half_to_float(uint2 v, int i) { return spr_half_to_float<T>(i < 2 ? v.x : v.y, i % 2); }
