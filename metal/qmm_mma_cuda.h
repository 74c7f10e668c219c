// Helpers of qmm_mma.kernel, CUDA only: the tensor-core MMA (m16n8k16, fp32 accumulators) and
// packing two floats into the register pair of the activation type. Under NVRTC (__CUDACC__)
// they are PTX; in the CPU's lockstep emulation (SPR_SIMT) the warp computes the MMA from the
// fragments; elsewhere (the g++ check against metal/stub/) a scalar stand-in with the same
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
#elif defined(SPR_SIMT)
// the lockstep emulation (tests/kernels/simt/simt.h): the warp's lanes compute it together
template <typename T>
SPR_FN void spr_mma(float* d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1) {
  simt::mma<T>(d, a0, a1, a2, a3, b0, b1);
}
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

// value hi (0: the low half, 1: the high) of a register pair of the activation type, as a float
template <typename T>
SPR_FN float spr_half_of(uint word, int hi) {
  const unsigned short bits = static_cast<unsigned short>(hi ? word >> 16 : word & 0xFFFFu);
  return spr_to_float(*reinterpret_cast<const T*>(&bits));
}

// SPR_NORM_IN: a register pair of two activations -> the two times the norm's weights (w0, w1),
// each product rounded to T, adding the two activations' squares to ssq (the low one first)
template <typename T>
SPR_FN uint spr_norm_in2(uint word, float w0, float w1, float& ssq) {
  const float lo = spr_half_of<T>(word, 0);
  const float hi = spr_half_of<T>(word, 1);
  ssq = fmaf(lo, lo, ssq);
  ssq = fmaf(hi, hi, ssq);
  return spr_pack2<T>(lo * w0, hi * w1);
}

// SPR_NORM_IN: a 16-byte load of eight activations -> the eight times the norm's weights nwf,
// the squares of pair j added to ssq[j]: the sums the spread path's lanes keep, one a pair
template <typename T>
SPR_FN uint4 spr_norm_in8(const uint4& v, const float* nwf, float* ssq) {
  return make_uint4(spr_norm_in2<T>(v.x, nwf[0], nwf[1], ssq[0]), spr_norm_in2<T>(v.y, nwf[2], nwf[3], ssq[1]),
                    spr_norm_in2<T>(v.z, nwf[4], nwf[5], ssq[2]), spr_norm_in2<T>(v.w, nwf[6], nwf[7], ssq[3]));
}

// SPR_SWIGLU_IN: silu(gate) * up as MLX's ops compute it on rows of T: sigmoid, times the gate,
// times up, each rounded to T (the last rounding is the pack's)
template <typename T>
SPR_FN float spr_silu_times(float gate, float up) {
  const float sig = spr_to_float(static_cast<T>(1.0f / (1.0f + expf(-gate))));
  return spr_to_float(static_cast<T>(gate * sig)) * up;
}

// two of them: register pairs of gate and up values -> one of silu(gate) * up
template <typename T>
SPR_FN uint spr_swiglu2(uint gate, uint up) {
  return spr_pack2<T>(spr_silu_times<T>(spr_half_of<T>(gate, 0), spr_half_of<T>(up, 0)),
                      spr_silu_times<T>(spr_half_of<T>(gate, 1), spr_half_of<T>(up, 1)));
}

template <typename T>
SPR_FN uint4 spr_swiglu8(const uint4& gate, const uint4& up) {
  return make_uint4(spr_swiglu2<T>(gate.x, up.x), spr_swiglu2<T>(gate.y, up.y), spr_swiglu2<T>(gate.z, up.z),
                    spr_swiglu2<T>(gate.w, up.w));
}
