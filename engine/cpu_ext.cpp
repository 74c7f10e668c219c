// MLX operations of the engine's own for the CPU backend (engine/cpu_ext.py builds and loads this).
//
// MLX's Python API can register kernels for Metal and CUDA (mx.fast.metal_kernel, cuda_kernel) but
// not for the CPU: there a computation is a graph of MLX's own operations, each a scalar loop with
// a scheduling cost of a few microseconds. A C++ primitive compiled against the wheel's headers
// joins the graph like any other operation; its Python binding shares MLX's nanobind domain
// ("mlx"), so it takes and returns mx.array.
//
// The operations: rows_attention and draft_attention (below), the GDN core's gdn_step, gdn_chain,
// gdn_tree and gdn_commit (engine/gdn/core.py CpuCore; their own comment further down), rms_norm, rope,
// norm_products, mlp_block, softmax_rows, the MTP head's mtp_chain and the sampler's choose_rows and
// penalize_rows (each with its comment). Each is held to its twin in MLX's operations by the tests, and each computes a row the
// same way whatever the other rows of the call are. Built with -ffp-contract=off
// (engine/cpu_ext.py), so a product and a sum are rounded apart wherever they appear unless the code
// fuses them itself (fused_madd, the same in every row), as those invariances need.
//
// rows_attention: attention of a few query rows (a decode step, a verify's tree) over a K/V cache
// in one operation. In MLX operations it is a product, a maximum, an exponential pass, a sum, a
// division and a second product, each reading or writing the whole score row: at 4,000 cached keys
// about 270 us a layer on the dev CPU, of which the softmax's passes alone were 115.
//
// Each query row sees the cache's first `prefix` keys and, of the `T` keys after them, those its
// row of `seen` marks (a verify's tree: its ancestors and itself). A row's keys are taken in that
// order ("logical" order) in chunks of CHUNK, each chunk's scores, maximum, exponentials, sum and
// weighted values computed by one thread, and the chunks joined in order. So a row's result
// depends only on the keys it sees and their order, not on how many rows the call has, which
// other rows they are, or where its tree keys sit in the cache: a verify row equals the decode
// step that sees the same keys, bit for bit (tests/engine/test_cpu_attention.py).

#include <dlfcn.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr int CHUNK = 512;  // keys a work item takes (of one KV head, one row)
constexpr int ROW_BLOCK = 8;  // rows a work item takes (a verify's; attention_items)
constexpr float LOG2E = 1.4426950408889634f;

// The GEMV shim's thread pool (engine/gemv_shim.c), where the process has preloaded it: items
// [i0, i1) of a job on this thread and its helpers. Without it, one thread.
using task_fn = void (*)(void*, int, int);
using parallel_fn = void (*)(task_fn, void*, int);

parallel_fn shim_parallel() {
  static parallel_fn fn = reinterpret_cast<parallel_fn>(dlsym(RTLD_DEFAULT, "spruce_parallel"));
  return fn;
}

void run_parallel(task_fn task, void* ctx, int n) {
  if (parallel_fn fn = shim_parallel(); fn != nullptr && n > 1) {
    fn(task, ctx, n);
  } else {
    task(ctx, 0, n);
  }
}

// An input's elements (float32, or int32 read as such) in row-major order: its own buffer where it
// is laid out so (the usual case), else gathered into `tmp` by its strides.
template <typename T>
const T* dense_as(const mx::array& a, std::vector<T>& tmp) {
  if (a.flags().row_contiguous) {
    return a.data<T>();
  }
  tmp.resize(a.size());
  const T* src = a.data<T>();
  std::vector<int64_t> index(a.ndim(), 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t at = 0;
    for (int d = 0; d < a.ndim(); ++d) {
      at += index[d] * a.strides(d);
    }
    tmp[i] = src[at];
    for (int d = a.ndim() - 1; d >= 0; --d) {
      if (++index[d] < a.shape(d)) {
        break;
      }
      index[d] = 0;
    }
  }
  return tmp.data();
}

inline const float* dense(const mx::array& a, std::vector<float>& tmp) { return dense_as<float>(a, tmp); }

// A [1, Hkv, L, D] input as rows of D elements (floats, or a half cache's 16-bit values): its base
// and head and row strides, in place where its rows are contiguous (a cache buffer's view), else
// gathered into `tmp`.
template <typename T>
void rows_view(const mx::array& a, std::vector<T>& tmp, const T** base, int64_t* head, int64_t* row) {
  if (a.strides(3) == 1) {
    *base = a.data<T>(), *head = a.strides(1), *row = a.strides(2);
    return;
  }
  *base = dense_as<T>(a, tmp), *row = a.shape(3), *head = (int64_t)a.shape(2) * a.shape(3);
}

// A primitive whose CPU evaluation runs `body` on (weak copies of) its inputs and its freshly
// allocated outputs, on the CPU stream's thread, as MLX's own CPU operations run.
class CpuPrimitive : public mx::Primitive {
 public:
  using Body = std::function<void(std::vector<mx::array>&, std::vector<mx::array>&)>;
  CpuPrimitive(mx::Stream s, const char* name, Body body) : mx::Primitive(s), name_(name), body_(std::move(body)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
    }
    for (auto& out : outputs) {
      encoder.set_output_array(out);
    }
    std::vector<mx::array> ins, outs;
    for (const auto& a : inputs) {
      ins.push_back(mx::array::unsafe_weak_copy(a));
    }
    for (auto& a : outputs) {
      outs.push_back(mx::array::unsafe_weak_copy(a));
    }
    encoder.dispatch([ins = std::move(ins), outs = std::move(outs), body = body_]() mutable { body(ins, outs); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name_) + " runs on the CPU only");
  }

  const char* name() const override { return name_; }

 private:
  const char* name_;
  Body body_;
};

mx::array cpu_op(const char* name, mx::Shape shape, CpuPrimitive::Body body, std::vector<mx::array> inputs) {
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<CpuPrimitive>(mx::default_stream(mx::Device::cpu), name, std::move(body)),
                   std::move(inputs));
}

// Every input in row-major order (float32, or int32: the wrappers check), in place or gathered.
struct DenseInputs {
  std::vector<std::vector<float>> f;
  std::vector<std::vector<int32_t>> i;
  std::vector<const void*> p;
  explicit DenseInputs(const std::vector<mx::array>& ins) : f(ins.size()), i(ins.size()), p(ins.size()) {
    for (size_t n = 0; n < ins.size(); ++n) {
      p[n] = ins[n].dtype() == mx::float32 ? (const void*)dense(ins[n], f[n])
                                           : (const void*)dense_as<int32_t>(ins[n], i[n]);
    }
  }
  const float* operator()(int n) const { return static_cast<const float*>(p[n]); }
  const int32_t* ints(int n) const { return static_cast<const int32_t*>(p[n]); }
};

void check_f32(const char* what, std::initializer_list<const mx::array*> arrays) {
  for (const auto* x : arrays) {
    if (x->dtype() != mx::float32) {
      throw std::invalid_argument(std::string(what) + ": float32 only");
    }
  }
}

struct AttentionJob {
  const float* q;  // [H, N, D], contiguous
  // [Hkv, L, D] with strides (k_head, k_row, 1): the prefix's keys. Float32, or the bits of the
  // halves `kernel` reads (key_row casts to its element type; strides count elements)
  const float* k;
  const float* v;
  // where the rows' own keys (their tree keys) are: the same buffer after the prefix (a verify),
  // or a drafted row's scratch (draft_attention), with their own strides
  const float* k2;
  const float* v2;
  int64_t k2_head, k2_row, v2_head, v2_row;
  float* out;        // [H, N, D]
  int64_t k_head, k_row, v_head, v_row;
  mx::Dtype kv = mx::float32;  // what k, v, k2 and v2 hold (chunk_kernel's element type)
  bool heads_together = true;  // a half or 8-bit cache's scores through scores16_heads (false: scores16)
  int H, Hkv, N, D, prefix;
  float scale;
  int chunks;  // chunks a row of the longest key list has
  // per row: its tree keys' indices (into the cache), in order, and how many keys it sees
  std::vector<std::vector<int>> tree_keys;
  std::vector<int> counts;
  // per item (KV head, row, chunk): G maxima, G sums, G x D weighted values
  std::vector<float> partial;
  float* parts = nullptr;  // partial's data, written by the items
  void (*kernel)(const AttentionJob&, int, int, int, int) = nullptr;  // chunk_kernel(G, D, kv)
  int stride() const { return (H / Hkv) * (2 + D); }
};

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // an unaligned load
typedef int v16i __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// The 16 lanes summed in a fixed tree (a float sum's order is its result: the same everywhere this
// runs; a chain of 16 dependent adds would cost more than a dot's products).
inline float lanes_sum(v16 x) {
  // lane i + lane i + 8, then + 4, then the last four in pairs
#if defined(__clang__) || __GNUC__ >= 12
  const v8 a8 = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 a4 = __builtin_shufflevector(a8, a8, 0, 1, 2, 3) + __builtin_shufflevector(a8, a8, 4, 5, 6, 7);
#else  // the same sums lane by lane (GCC has __builtin_shufflevector from version 12; this is slower)
  const v8 a8 = {x[0] + x[8], x[1] + x[9], x[2] + x[10], x[3] + x[11],
                 x[4] + x[12], x[5] + x[13], x[6] + x[14], x[7] + x[15]};
  const v4 a4 = {a8[0] + a8[4], a8[1] + a8[5], a8[2] + a8[6], a8[3] + a8[7]};
#endif
  return (a4[0] + a4[2]) + (a4[1] + a4[3]);
}

// lanes_sum of 16 vectors at once, lane j of the result being x[j]'s sum, with the same adds in the
// same order (so the same bits): each step's two shuffles and one add serve 16 sums, where
// lanes_sum spends a shuffle chain and a scalar on one. It pays where the keys come from L1 (a
// verify's rows, a prefill block); one decode row over a long cache waits on memory either way
// (4,000 keys: 105 against 108 us, dev CPU).
#if defined(__clang__) || __GNUC__ >= 12
inline v16 sum_halves(v16 a, v16 b) {  // every 16 lanes: lane i + lane i + 8 (a's eight, then b's)
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline v16 sum_quarters(v16 a, v16 b) {  // every 8 lanes: lane i + lane i + 4
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline v16 sum_crossed(v16 a, v16 b) {  // every 4 lanes: lane 0 + lane 2, lane 1 + lane 3
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline v16 sum_pairs(v16 a, v16 b) {  // every 2 lanes: lane 0 + lane 1
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
inline v16 lanes_sums16(const v16* x) {
  v16 h[8], q[4];
  for (int i = 0; i < 8; ++i) {
    h[i] = sum_halves(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    q[i] = sum_quarters(h[2 * i], h[2 * i + 1]);
  }
  return sum_pairs(sum_crossed(q[0], q[1]), sum_crossed(q[2], q[3]));
}
#else
inline v16 lanes_sums16(const v16* x) {
  v16 out;
  for (int i = 0; i < 16; ++i) {
    out[i] = lanes_sum(x[i]);
  }
  return out;
}
#endif

// 2^x for x <= 126, 16 at a time: x = n + f with n an integer and f in [-0.5, 0.5], 2^f by its
// Taylor series to degree 7 (relative error below 1e-8, under float32's half ulp), 2^n added to
// the exponent's bits. x below -125 is taken as -125: a weight of ~1e-38 next to the row's
// largest, 1, where exp2f gives a subnormal or 0. libm's exp2f is a call an element (~4 ns here).
inline v16 exp2_lanes(v16 x) {
  const v16 floor_ = (v16){} - 125.0f;
  x = x < floor_ ? floor_ : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (|x| < 2^22)
  const v16 n = (x + magic) - magic;
  const v16 f = x - n;
  constexpr float c1 = 0.6931471805599453f, c2 = 0.2402265069591007f, c3 = 0.05550410866482158f,
                  c4 = 0.009618129107628477f, c5 = 0.0013333558146428443f, c6 = 0.00015403530393381609f,
                  c7 = 1.525273380405984e-05f;
  v16 p = (v16){} + c7;
  p = p * f + c6;
  p = p * f + c5;
  p = p * f + c4;
  p = p * f + c3;
  p = p * f + c2;
  p = p * f + c1;
  p = p * f + 1.0f;
  return (v16)((v16i)p + (__builtin_convertvector(n, v16i) << 23));
}

// 2^x for any x: exp2_lanes' series with x taken within [-125, 126] (2^126 stands in for an
// overflow: 1 / (1 + 2^126) is 0 to float32 as 1 / inf is).
inline v16 exp2_any(v16 x) {
  const v16 top = (v16){} + 126.0f;
  return exp2_lanes(x > top ? top : x);
}

// a * b + c rounded once where the CPU has a fused multiply-add, else rounded twice: written out
// where it is wanted (the attention operations' products), since this file is built with
// -ffp-contract=off so that the compiler fuses nothing on its own, in one place and not another.
// Every row of rows_attention takes the same calls whatever the call's other rows, so a verify row
// is still the step's bits.
inline v16 fused_madd(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && (defined(__clang__) || __GNUC__ >= 12)
  const v8 lo = (v8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                                    (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                    (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  const v8 hi = (v8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                                    (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                                    (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return a * b + c;
#endif
}

// The largest of the 16 lanes (exact whatever the order), in a tree: a chain of 15 would sit on the
// path from a tile's scores to its exponentials.
inline float lanes_max(v16 x) {
#if defined(__clang__) || __GNUC__ >= 12
  const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7),
           b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 m8 = a > b ? a : b;
  const v4 c = __builtin_shufflevector(m8, m8, 0, 1, 2, 3), d = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  const v4 m4 = c > d ? c : d;
  return std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3]));
#else
  float top = x[0];
  for (int i = 1; i < 16; ++i) {
    top = std::max(top, x[i]);
  }
  return top;
#endif
}

// x in all 16 lanes (one broadcast; `(v16){} + x` is an add first, since 0 + -0 is +0).
inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// 16 keys' or values' elements as floats, from a float32 cache or a half one (engine/cache.py
// KVCache.dtype): a half is widened exactly, in the load, so a half cache's rows attend with the
// arithmetic and the bits of their float32 copies, and half the bytes come from memory (one row over
// 4,000 / 16,000 / 32,000 keys, 2 K/V heads of 64, the cache's rows from memory: 1.2-1.7x faster,
// dev CPU; BENCHMARKS.md, issue 17, fifty-third session). Widening into a buffer first, then the
// float32 loop, was slower than float32 itself.
struct f16_bits {  // an IEEE half's bits
  uint16_t b;
};
struct bf16_bits {  // a bfloat16's bits
  uint16_t b;
};
// An 8-bit cache's row (engine/kv_int8.py): D int8 values, then the row's float32 scale in the next
// 4 bytes; an element's value is (float)q * scale, one rounded product, as its float32 copy's is.
struct q8_bits {
  int8_t b;
};
typedef int8_t v16sb __attribute__((vector_size(16), aligned(1)));
typedef uint16_t v16us __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16ui __attribute__((vector_size(64)));
inline v16 load16(const float* p) { return *(const v16u*)p; }
inline v16 load16(const q8_bits* p) {  // unscaled: load_row multiplies by the row's scale
#if defined(__AVX512F__)
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128((const __m128i*)p);
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  return __builtin_shufflevector((v8)lo, (v8)hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return __builtin_convertvector(__builtin_convertvector(*(const v16sb*)p, v16i), v16);
#endif
}
template <int DV>
inline float row_scale(const q8_bits* row) {
  float scale;
  std::memcpy(&scale, row + DV * 16, sizeof(float));
  return scale;
}
inline v16 load16(const bf16_bits* p) { return (v16)(__builtin_convertvector(*(const v16us*)p, v16ui) << 16); }
inline v16 load16(const f16_bits* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)));
  return __builtin_shufflevector((v8)lo, (v8)hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  v16 out;
  for (int i = 0; i < 16; ++i) {  // by the fields: sign, exponent (bias 15), 10-bit mantissa
    const uint32_t x = p[i].b, sign = (x & 0x8000u) << 16, e = (x >> 10) & 0x1fu, m = x & 0x3ffu;
    uint32_t bits;
    if (e == 0x1fu) {
      bits = sign | 0x7f800000u | (m << 13);  // infinity, NaN
    } else if (e != 0) {
      bits = sign | ((e + 112u) << 23) | (m << 13);
    } else {  // zero or subnormal: m * 2^-24, exact in float32
      float f = std::ldexp((float)m, -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
    std::memcpy(&out[i], &bits, 4);
  }
  return out;
#endif
}

// A row of DV x 16 floats into registers (an 8-bit row's elements times its scale).
template <int DV, typename KT = float>
inline void load_row(const KT* row, v16* out) {
  if constexpr (std::is_same_v<KT, q8_bits>) {
    const v16 scale = splat(row_scale<DV>(row));
    for (int dv = 0; dv < DV; ++dv) {
      out[dv] = load16(row + dv * 16) * scale;
    }
  } else {
    for (int dv = 0; dv < DV; ++dv) {
      out[dv] = load16(row + dv * 16);
    }
  }
}

// A query q (DV x 16 floats, in registers) against one key row: its lane products, fused where
// the CPU fuses; lanes_sum of it is the score.
template <int DV, typename KT = float>
inline v16 dot_lanes(const v16* q, const KT* key) {
  if constexpr (std::is_same_v<KT, q8_bits>) {
    v16 k[DV];
    load_row<DV, KT>(key, k);
    v16 a = q[0] * k[0];
    for (int dv = 1; dv < DV; ++dv) {
      a = fused_madd(q[dv], k[dv], a);
    }
    return a;
  }
  v16 a = q[0] * load16(key);
  for (int dv = 1; dv < DV; ++dv) {
    a = fused_madd(q[dv], load16(key + dv * 16), a);
  }
  return a;
}

// The scores of q against 16 key rows, lane i key i's: each key's lane products summed as
// lanes_sum sums one (the same bits as dot_lanes then lanes_sum, key by key).
template <int DV, typename KT = float>
inline v16 scores16(const v16* q, const KT* const* keys) {
  v16 a[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = dot_lanes<DV, KT>(q, keys[i]);
  }
  return lanes_sums16(a);
}

// scores16 for the G query heads of a KV head at once: each key row loaded once for all of them,
// where scores16 would load it once a head. The arithmetic of each score is scores16's (the same
// products, in the same order, the same lane sums), so the same bits. It pays for a half cache,
// whose loads widen each element (a conversion per load): with the bundled target's 3 heads a K/V
// head, one row over a float16 cache went from 1.13-1.19x to 1.36-1.39x of a float32 cache's speed
// at 4,000 keys and from 1.22-1.34x to 1.66-1.74x at 16,000 (scripts/bench_cpu_attention.py --kv,
// dev CPU). A float32 cache keeps scores16, whose loads are operands of the products: the same
// change read within noise there.
template <int G, int DV, typename KT>
inline void scores16_heads(const v16 (*qs)[DV], const KT* const* keys, v16* out) {
  v16 a[G][16];
  for (int i = 0; i < 16; ++i) {
    v16 k[DV];
    load_row<DV, KT>(keys[i], k);
    for (int g = 0; g < G; ++g) {
      v16 x = qs[g][0] * k[0];
      for (int dv = 1; dv < DV; ++dv) {
        x = fused_madd(qs[g][dv], k[dv], x);
      }
      a[g][i] = x;
    }
  }
  for (int g = 0; g < G; ++g) {
    out[g] = lanes_sums16(a[g]);
  }
}

// The key (value) at logical position j of row n of KV head h: the prefix in order, then the
// row's own keys.
template <typename KT = float>
inline const KT* key_row(const AttentionJob& job, int h, int n, int j) {
  return j < job.prefix ? (const KT*)job.k + h * job.k_head + (int64_t)j * job.k_row
                        : (const KT*)job.k2 + h * job.k2_head + (int64_t)job.tree_keys[n][j - job.prefix] * job.k2_row;
}

template <typename KT = float>
inline const KT* value_row(const AttentionJob& job, int h, int n, int j) {
  return j < job.prefix ? (const KT*)job.v + h * job.v_head + (int64_t)j * job.v_row
                        : (const KT*)job.v2 + h * job.v2_head + (int64_t)job.tree_keys[n][j - job.prefix] * job.v2_row;
}

// One work item: KV head h, chunk c, rows [n0, n1) -> each row's G query heads' (of this KV head)
// maxima, sums and unnormalised outputs, for G query heads of DV x 16 dimensions. The chunk's keys
// are taken SUB at a time, each sub-tile by every row of the item in turn (its keys and values then
// come from L1, not once a row from L2), and a row's arithmetic is what it would be alone: its
// scores key by key, its maximum, exponentials and sum over the chunk, its weighted values summed
// in key order. Rows past their keys write nothing and are skipped when joining.
constexpr int SUB = 64;  // keys a sub-tile has: a multiple of 16

template <int G, int DV, typename KT = float>
void attention_chunk(const AttentionJob& job, int h, int n0, int n1, int c) {
  constexpr int D = DV * 16, ROW = G * (CHUNK + 16);  // a row's scores: G x the chunk, padded
  const int j0 = c * CHUNK, nr = n1 - n0;
  thread_local std::vector<v16> score_rows, acc_rows;
  score_rows.resize((size_t)nr * ROW / 16);
  acc_rows.assign((size_t)nr * G * DV, v16{});
  float m[ROW_BLOCK][G];
  int ends[ROW_BLOCK];  // each row's end of keys in this chunk (<= j0: none)
  for (int r = 0; r < nr; ++r) {
    ends[r] = std::min(job.counts[n0 + r], j0 + CHUNK);
    for (int g = 0; g < G; ++g) {
      m[r][g] = -INFINITY;
    }
  }
  for (int s0 = j0; s0 < j0 + CHUNK; s0 += SUB) {  // scores
    for (int r = 0; r < nr; ++r) {
      const int n = n0 + r, s1 = std::min(ends[r], s0 + SUB);
      if (s1 <= s0) {
        continue;
      }
      float* scores = (float*)&score_rows[(size_t)r * ROW / 16];  // [G][CHUNK + 16]
      v16 qs[G][DV];  // the query rows, scaled as the operations' path scales them
      for (int g = 0; g < G; ++g) {
        const float* q = job.q + ((int64_t)(h * G + g) * job.N + n) * D;
        for (int dv = 0; dv < DV; ++dv) {
          qs[g][dv] = *(const v16u*)(q + dv * 16) * job.scale;
        }
      }
      int j = s0;
      v16 tops[G];  // the sub-tile's maxima, lane by lane
      for (int g = 0; g < G; ++g) {
        tops[g] = splat(-INFINITY);
      }
      for (; j + 16 <= s1; j += 16) {  // 16 keys at a time, a head at a time, summed across lanes together
        const KT* rows[16];
        for (int i = 0; i < 16; ++i) {
          rows[i] = key_row<KT>(job, h, n, j + i);
        }
        v16 sc[G];
        if (std::is_same_v<KT, float> || !job.heads_together) {
          for (int g = 0; g < G; ++g) {
            sc[g] = scores16<DV, KT>(qs[g], rows);
          }
        } else {
          scores16_heads<G, DV, KT>(qs, rows, sc);
        }
        for (int g = 0; g < G; ++g) {
          *(v16*)&scores[g * (CHUNK + 16) + j - j0] = sc[g];  // j - j0 is a multiple of 16: aligned
          tops[g] = tops[g] > sc[g] ? tops[g] : sc[g];
        }
      }
      for (int g = 0; g < G; ++g) {
        m[r][g] = std::max(m[r][g], lanes_max(tops[g]));
      }
      for (; j < s1; ++j) {  // the row's last keys one by one, with the same arithmetic
        const KT* key = key_row<KT>(job, h, n, j);
        for (int g = 0; g < G; ++g) {
          const float sc = lanes_sum(dot_lanes<DV, KT>(qs[g], key));
          scores[g * (CHUNK + 16) + j - j0] = sc;
          m[r][g] = std::max(m[r][g], sc);
        }
      }
    }
  }
  for (int r = 0; r < nr; ++r) {  // exponentials and sums, row by row
    const int count = ends[r] - j0;
    if (count <= 0) {
      continue;
    }
    float* part = job.parts + ((int64_t)(h * job.N + n0 + r) * job.chunks + c) * job.stride();
    float* scores = (float*)&score_rows[(size_t)r * ROW / 16];
    const int padded = (count + 15) / 16 * 16;
    for (int g = 0; g < G; ++g) {
      float* sg = scores + g * (CHUNK + 16);
      v16 sum = {};
      for (int j = 0; j < padded; j += 16) {
        v16 e = exp2_lanes((*(v16*)&sg[j] - m[r][g]) * LOG2E);
        if (j + 16 > count) {  // the lanes past the chunk's keys weigh nothing
          for (int i = count - j; i < 16; ++i) {
            e[i] = 0.0f;
          }
        }
        *(v16*)&sg[j] = e;
        sum += e;
      }
      part[g] = m[r][g];
      part[G + g] = lanes_sum(sum);
    }
  }
  for (int s0 = j0; s0 < j0 + CHUNK; s0 += SUB) {  // weighted values, each row's keys in order
    for (int r = 0; r < nr; ++r) {
      const int n = n0 + r, s1 = std::min(ends[r], s0 + SUB);
      if (s1 <= s0) {
        continue;
      }
      const float* scores = (const float*)&score_rows[(size_t)r * ROW / 16];
      v16* ar = &acc_rows[(size_t)r * G * DV];
      v16 acc[G][DV];
      for (int g = 0; g < G; ++g) {
        for (int dv = 0; dv < DV; ++dv) {
          acc[g][dv] = ar[g * DV + dv];
        }
      }
      for (int j = s0; j < s1; ++j) {
        v16 vr[DV];
        load_row<DV, KT>(value_row<KT>(job, h, n, j), vr);
        for (int g = 0; g < G; ++g) {
          const v16 p = splat(scores[g * (CHUNK + 16) + j - j0]);
          for (int dv = 0; dv < DV; ++dv) {
            acc[g][dv] = fused_madd(p, vr[dv], acc[g][dv]);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int dv = 0; dv < DV; ++dv) {
          ar[g * DV + dv] = acc[g][dv];
        }
      }
    }
  }
  for (int r = 0; r < nr; ++r) {
    if (ends[r] <= j0) {
      continue;
    }
    float* out = job.parts + ((int64_t)(h * job.N + n0 + r) * job.chunks + c) * job.stride() + 2 * G;
    std::memcpy(out, &acc_rows[(size_t)r * G * DV], sizeof(v16) * G * DV);
  }
}

using chunk_fn = void (*)(const AttentionJob&, int, int, int, int);

template <int DV, typename KT>
chunk_fn chunk_for_heads(int G) {
  switch (G) {
    case 1: return attention_chunk<1, DV, KT>;
    case 2: return attention_chunk<2, DV, KT>;
    case 3: return attention_chunk<3, DV, KT>;
    case 4: return attention_chunk<4, DV, KT>;
    case 5: return attention_chunk<5, DV, KT>;
    case 6: return attention_chunk<6, DV, KT>;
    case 7: return attention_chunk<7, DV, KT>;
    case 8: return attention_chunk<8, DV, KT>;
    default: return nullptr;
  }
}

template <typename KT>
chunk_fn chunk_for_dims(int G, int D) {
  switch (D) {
    case 16: return chunk_for_heads<1, KT>(G);
    case 32: return chunk_for_heads<2, KT>(G);
    case 64: return chunk_for_heads<4, KT>(G);
    case 128: return chunk_for_heads<8, KT>(G);
    case 256: return chunk_for_heads<16, KT>(G);
    default: return nullptr;
  }
}

// The item kernel for G query heads a KV head and head dimension D; null where none is built (the
// caller keeps MLX's operations then: engine/cpu_ext.py asks `rows_attention_supports`).
// Keys and values of `kv`: float32 (the default), float16, bfloat16 or int8 (q8_bits rows).
chunk_fn chunk_kernel(int G, int D, mx::Dtype kv = mx::float32) {
  if (kv == mx::int8) {
    return chunk_for_dims<q8_bits>(G, D);
  }
  if (kv == mx::float16) {
    return chunk_for_dims<f16_bits>(G, D);
  }
  if (kv == mx::bfloat16) {
    return chunk_for_dims<bf16_bits>(G, D);
  }
  return chunk_for_dims<float>(G, D);
}

// An item: K/V head h, chunk c, and a block of up to ROW_BLOCK rows (attention_chunk), so that a
// verify's rows read the chunk's keys and values from memory once (one item a row read them once a
// row: 17 rows over 1,000 keys took 20x one row's time on the dev CPU).
int row_blocks(const AttentionJob& job) { return (job.N + ROW_BLOCK - 1) / ROW_BLOCK; }

void attention_items(void* ctx, int i0, int i1) {
  auto& job = *static_cast<AttentionJob*>(ctx);
  const int blocks = row_blocks(job);
  for (int i = i0; i < i1; ++i) {
    const int c = i % job.chunks, hb = i / job.chunks;
    const int b = hb % blocks, h = hb / blocks;
    job.kernel(job, h, b * ROW_BLOCK, std::min(job.N, (b + 1) * ROW_BLOCK), c);
  }
}

// The chunks of each (KV head, row) joined in order: rescaled to the largest maximum, summed.
void join_chunks(AttentionJob& job) {
  const int G = job.H / job.Hkv, D = job.D;
  for (int h = 0; h < job.Hkv; ++h) {
    for (int n = 0; n < job.N; ++n) {
      const int used = (job.counts[n] + CHUNK - 1) / CHUNK;
      const float* first = job.partial.data() + (int64_t)((h * job.N + n) * job.chunks) * job.stride();
      for (int g = 0; g < G; ++g) {
        float* out = job.out + ((int64_t)(h * G + g) * job.N + n) * D;
        float top = -INFINITY;
        for (int c = 0; c < used; ++c) {
          top = std::max(top, first[c * job.stride() + g]);
        }
        float sum = 0.0f;
        std::memset(out, 0, sizeof(float) * D);
        for (int c = 0; c < used; ++c) {
          const float* part = first + c * job.stride();
          const float w = used == 1 ? 1.0f : exp2f((part[g] - top) * LOG2E);
          sum += w * part[G + g];
          const float* acc = part + 2 * G + g * D;
          for (int d = 0; d < D; ++d) {
            out[d] += w * acc[d];
          }
        }
        for (int d = 0; d < D; ++d) {
          out[d] /= sum;
        }
      }
    }
  }
}

// The job's rows (their prefix and tree_keys set) on the pool's threads, then joined into out.
void run_attention(AttentionJob& job) {
  job.kernel = chunk_kernel(job.H / job.Hkv, job.D, job.kv);
  job.counts.resize(job.N);
  int longest = 0;
  for (int n = 0; n < job.N; ++n) {
    job.counts[n] = job.prefix + (int)job.tree_keys[n].size();
    longest = std::max(longest, job.counts[n]);
  }
  job.chunks = std::max(1, (longest + CHUNK - 1) / CHUNK);
  job.partial.resize((int64_t)job.Hkv * job.N * job.chunks * job.stride());
  job.parts = job.partial.data();
  run_parallel(attention_items, &job, job.Hkv * row_blocks(job) * job.chunks);
  join_chunks(job);
}

// q [1, H, N, D] float32, keys / values [1, Hkv, L, D] (float32, or float16 / bfloat16 from a half
// cache, or [1, Hkv, L, D + 4] int8 from an 8-bit one (q8_bits rows), read as their float32 copies
// would be; the rows of a head may be a view into a longer cache), seen [N, L - prefix] bool or
// none -> [1, H, N, D] float32.
mx::array rows_attention(const mx::array& q, const mx::array& keys, const mx::array& values, float scale,
                         int prefix, const std::optional<mx::array>& seen, bool heads_together) {
  if (q.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4 || q.shape(0) != 1 || keys.shape(0) != 1) {
    throw std::invalid_argument("rows_attention: q [1, H, N, D], keys and values [1, Hkv, L, D]");
  }
  const int H = q.shape(1), N = q.shape(2), D = q.shape(3), Hkv = keys.shape(1), L = keys.shape(2);
  check_f32("rows_attention", {&q});
  if (keys.dtype() != values.dtype() || (keys.dtype() != mx::float32 && keys.dtype() != mx::float16 &&
                                         keys.dtype() != mx::bfloat16 && keys.dtype() != mx::int8)) {
    throw std::invalid_argument("rows_attention: keys and values float32, float16, bfloat16 or int8, the same");
  }
  const int row_extra = keys.dtype() == mx::int8 ? (int)sizeof(float) : 0;  // an 8-bit row's scale
  if (keys.shape() != values.shape() || keys.shape(3) != D + row_extra || Hkv < 1 || H % Hkv != 0 ||
      chunk_kernel(H / Hkv, D) == nullptr || prefix < 0 || prefix > L || (!seen && prefix != L)) {
    throw std::invalid_argument("rows_attention: shapes do not match");
  }
  if (seen && (seen->ndim() != 2 || seen->shape(0) != N || seen->shape(1) != L - prefix || seen->dtype() != mx::bool_)) {
    throw std::invalid_argument("rows_attention: seen must be bool [N, L - prefix]");
  }
  std::vector<mx::array> inputs = {q, keys, values};  // the cache's views read in place (rows_view)
  if (seen) {
    inputs.push_back(*seen);
  }
  auto body = [scale, prefix, heads_together](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const mx::array &q = ins[0], &k = ins[1], &v = ins[2];
    AttentionJob job;
    job.H = q.shape(1), job.N = q.shape(2), job.D = q.shape(3);
    job.Hkv = k.shape(1), job.prefix = prefix, job.scale = scale, job.heads_together = heads_together;
    const int T = k.shape(2) - prefix;  // the keys after the prefix: the tree's
    std::vector<float> q_rows, k_rows, v_rows;
    job.q = dense(q, q_rows);
    std::vector<uint16_t> kh_rows, vh_rows;
    std::vector<int8_t> kq_rows, vq_rows;
    if (k.dtype() == mx::float32) {
      rows_view(k, k_rows, &job.k, &job.k_head, &job.k_row);
      rows_view(v, v_rows, &job.v, &job.v_head, &job.v_row);
    } else if (k.dtype() == mx::int8) {  // an 8-bit cache: its rows read in place (q8_bits)
      job.kv = k.dtype();
      const int8_t *kq, *vq;
      rows_view(k, kq_rows, &kq, &job.k_head, &job.k_row);
      rows_view(v, vq_rows, &vq, &job.v_head, &job.v_row);
      job.k = reinterpret_cast<const float*>(kq), job.v = reinterpret_cast<const float*>(vq);
    } else {  // a half cache: its elements read in place, as the item kernel for their type reads them
      job.kv = k.dtype();
      const uint16_t *kh, *vh;
      rows_view(k, kh_rows, &kh, &job.k_head, &job.k_row);
      rows_view(v, vh_rows, &vh, &job.v_head, &job.v_row);
      job.k = reinterpret_cast<const float*>(kh), job.v = reinterpret_cast<const float*>(vh);
    }
    job.k2 = job.k, job.v2 = job.v;  // a row's tree keys are in the same buffer, after the prefix
    job.k2_head = job.k_head, job.k2_row = job.k_row, job.v2_head = job.v_head, job.v2_row = job.v_row;
    std::vector<bool> seen_rows;
    if (ins.size() == 4) {
      const mx::array& seen = ins[3];
      seen_rows.resize(seen.size());
      for (int n = 0; n < seen.shape(0); ++n) {  // by its strides: it may be a view
        for (int t = 0; t < seen.shape(1); ++t) {
          seen_rows[(size_t)n * seen.shape(1) + t] = seen.data<bool>()[n * seen.strides(0) + t * seen.strides(1)];
        }
      }
    }
    job.out = outs[0].data<float>();
    job.tree_keys.resize(job.N);
    for (int n = 0; n < job.N; ++n) {
      for (int t = 0; t < T; ++t) {
        if (seen_rows.empty() || seen_rows[(size_t)n * T + t]) {
          job.tree_keys[n].push_back(prefix + t);
        }
      }
    }
    run_attention(job);
  };
  return cpu_op("RowsAttention", {1, H, N, D}, body, std::move(inputs));
}

// A drafted row's attention (engine/models/mtp.py scratch_attention): queries q [1, H, N, D] over
// rows [0, length) of the committed K/V buffers [1, Hkv, cap, D] and rows [0, j] of the draft's
// scratch [1, Hkv, S, D], length and j int32 scalars read when it runs (so a compiled per-depth step
// does not depend on them) -> [1, H, N, D]. The ops form scores the whole buffer and masks it;
// this reads the rows that count. The MTP head drafts one row (N = 1); a DFlash block's N rows all
// see the context and the whole block (j = N - 1; engine/models/dflash.py).
mx::array draft_attention(const mx::array& q, const mx::array& keys, const mx::array& values, const mx::array& length,
                          const mx::array& skeys, const mx::array& svalues, const mx::array& j, float scale) {
  for (const auto* a : {&q, &keys, &values, &skeys, &svalues}) {
    if (a->dtype() != mx::float32) {
      throw std::invalid_argument("draft_attention: float32 only");
    }
    if (a->ndim() != 4 || a->shape(0) != 1 || a->shape(3) != q.shape(3)) {
      throw std::invalid_argument("draft_attention: shapes do not match");
    }
  }
  const int H = q.shape(1), N = q.shape(2), D = q.shape(3), Hkv = keys.shape(1);
  if (N < 1 || values.shape() != keys.shape() || skeys.shape() != svalues.shape() || skeys.shape(1) != Hkv ||
      Hkv < 1 || H % Hkv != 0 || chunk_kernel(H / Hkv, D) == nullptr || length.size() != 1 ||
      j.size() != 1 || length.dtype() != mx::int32 || j.dtype() != mx::int32) {
    throw std::invalid_argument("draft_attention: shapes do not match");
  }
  auto body = [scale](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const mx::array &q = ins[0], &k = ins[1], &v = ins[2], &sk = ins[4], &sv = ins[5];
    AttentionJob job;
    job.H = q.shape(1), job.N = q.shape(2), job.D = q.shape(3), job.Hkv = k.shape(1), job.scale = scale;
    const int cap = k.shape(2), rows = sk.shape(2);
    job.prefix = std::clamp(ins[3].data<int32_t>()[0], 0, cap);
    const int own = std::clamp(ins[6].data<int32_t>()[0], 0, rows - 1);
    std::vector<float> q_rows, tmp[4];
    job.q = dense(q, q_rows);
    rows_view(k, tmp[0], &job.k, &job.k_head, &job.k_row);
    rows_view(v, tmp[1], &job.v, &job.v_head, &job.v_row);
    rows_view(sk, tmp[2], &job.k2, &job.k2_head, &job.k2_row);
    rows_view(sv, tmp[3], &job.v2, &job.v2_head, &job.v2_row);
    job.out = outs[0].data<float>();
    job.tree_keys.assign(job.N, std::vector<int>());
    for (auto& own_keys : job.tree_keys) {
      for (int t = 0; t <= own; ++t) {
        own_keys.push_back(t);
      }
    }
    run_attention(job);
  };
  return cpu_op("DraftAttention", {1, H, N, D}, body, {q, keys, values, length, skeys, svalues, j});
}

// ---- A prefill chunk's attention ----------------------------------------------------------------
//
// causal_attention: the T query rows of a prefill chunk are the last T positions of the L keys (the
// cache's earlier rows, then the chunk's own): row t sees keys 0 .. L - T + t. In MLX's operations
// this is two GEMMs around a softmax over an [H, T, L] score array written and read back through
// memory (512 rows over 4,000 keys: 49 MB a layer, ~45 % of a 4k prompt's prefill on the dev CPU),
// and past ~10k keys MLX's fused CPU kernel, slower still. Here a work item is a block of CA_ROWS
// rows of one K/V head (its G query heads' rows), which walks the keys in tiles of CA_TILE with a
// running maximum and sum per query (the output rescaled when the maximum grows): a tile's keys and
// values are read from L1 by every query of the block, and no score leaves the cache. A row's
// result depends only on its query, the keys it sees and the tiles' boundaries (multiples of
// CA_TILE from key 0): not on the chunk or the block that holds it, so a prompt prefilled in chunks
// of any size, or its tail after a prefix-cache hit, gets the same bits.
constexpr int CA_ROWS = 16;  // query rows a work item takes (of one K/V head, its G heads each)
constexpr int CA_TILE = 32;  // keys a tile has: a multiple of 16

struct CausalJob {
  const float* q;  // [H, T, D], contiguous
  const float* k;  // [Hkv, L, D] with strides (k_head, k_row, 1)
  const float* v;
  float* out;  // [H, T, D]
  int64_t k_head, k_row, v_head, v_row;
  int H, Hkv, T, L, D, blocks;
  float scale;
  void (*kernel)(const CausalJob&, int, int) = nullptr;
};

// K/V head h, row block b: its rows' G queries, each walking its tiles with its own running state.
template <int DV>
void causal_block(const CausalJob& job, int h, int b) {
  constexpr int D = DV * 16, GROUPS = CA_TILE / 16, SETS = DV >= 8 ? 1 : 8 / DV;
  const int G = job.H / job.Hkv, prefix = job.L - job.T;
  const int r0 = b * CA_ROWS, rows = std::min(job.T - r0, CA_ROWS), nq = G * rows;
  const int last = prefix + r0 + rows - 1;  // the last key the block's last row sees
  // per query i (head g = i / rows, row r0 + i % rows): scaled query, running max and sum, output
  thread_local std::vector<v16> qs, acc;
  thread_local std::vector<float> m, l;
  qs.resize((size_t)nq * DV), acc.assign((size_t)nq * DV, v16{}), m.assign(nq, -INFINITY), l.assign(nq, 0.0f);
  for (int i = 0; i < nq; ++i) {
    const float* q = job.q + ((int64_t)(h * G + i / rows) * job.T + r0 + i % rows) * D;
    for (int dv = 0; dv < DV; ++dv) {
      qs[(size_t)i * DV + dv] = *(const v16u*)(q + dv * 16) * job.scale;
    }
  }
  const float* kbase = job.k + h * job.k_head;
  const float* vbase = job.v + h * job.v_head;
  const v16 ninf = (v16){} - INFINITY, zero = {};
  const v16 lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int t0 = 0; t0 <= last; t0 += CA_TILE) {
    const int tile = std::min(CA_TILE, last + 1 - t0);  // keys of this tile anyone here sees
    const float* krow[CA_TILE];
    for (int j = 0; j < CA_TILE; ++j) {  // past the tile's end: any real row, masked below
      krow[j] = kbase + (int64_t)(t0 + (j < tile ? j : 0)) * job.k_row;
    }
    for (int i = 0; i < nq; ++i) {
      const int seen = std::min(tile, prefix + r0 + i % rows + 1 - t0);  // this row's keys in the tile
      if (seen <= 0) {
        continue;
      }
      const v16* qi = &qs[(size_t)i * DV];
      v16 sc[GROUPS], tops;
      for (int gi = 0; gi < GROUPS; ++gi) {
        sc[gi] = scores16<DV>(qi, krow + gi * 16);
        if (seen < CA_TILE) {  // a tile on the diagonal: the keys past the row's own are not seen
          sc[gi] = lane_index + (float)(gi * 16) < (float)seen ? sc[gi] : ninf;
        }
        tops = gi == 0 ? sc[0] : (tops > sc[gi] ? tops : sc[gi]);
      }
      const float top = lanes_max(tops);
      const float mi = m[i], mnew = std::max(mi, top);
      alignas(64) float p[CA_TILE];
      v16 sum = {};
      for (int gi = 0; gi < GROUPS; ++gi) {
        v16 e = exp2_lanes((sc[gi] - mnew) * LOG2E);
        e = sc[gi] == ninf ? zero : e;  // the unseen weigh nothing (exp2_lanes floors at 2^-125)
        *(v16*)&p[gi * 16] = e;
        sum += e;
      }
      v16* ai = &acc[(size_t)i * DV];
      if (mnew > mi && mi != -INFINITY) {  // the maximum grew: what came before is rescaled to it
        const float c = exp2f((mi - mnew) * LOG2E);
        l[i] *= c;
        for (int dv = 0; dv < DV; ++dv) {
          ai[dv] *= c;
        }
      }
      m[i] = mnew;
      l[i] += lanes_sum(sum);
      // SETS partial sums over the tile's keys (key j into set j % SETS), so that a short head's
      // few accumulators are not one chain of dependent adds; joined in order after the tile
      v16 part[SETS][DV];
      for (int dv = 0; dv < DV; ++dv) {
        part[0][dv] = ai[dv];
        for (int st = 1; st < SETS; ++st) {
          part[st][dv] = zero;
        }
      }
      int j = 0;
      for (; j + SETS <= seen; j += SETS) {
        for (int st = 0; st < SETS; ++st) {
          const float* vr = vbase + (int64_t)(t0 + j + st) * job.v_row;
          const v16 pj = splat(p[j + st]);
          for (int dv = 0; dv < DV; ++dv) {
            part[st][dv] = fused_madd(pj, *(const v16u*)(vr + dv * 16), part[st][dv]);
          }
        }
      }
      for (; j < seen; ++j) {
        const float* vr = vbase + (int64_t)(t0 + j) * job.v_row;
        const v16 pj = splat(p[j]);
        for (int dv = 0; dv < DV; ++dv) {
          part[0][dv] = fused_madd(pj, *(const v16u*)(vr + dv * 16), part[0][dv]);
        }
      }
      for (int dv = 0; dv < DV; ++dv) {
        v16 t = part[0][dv];
        for (int st = 1; st < SETS; ++st) {
          t += part[st][dv];
        }
        ai[dv] = t;
      }
    }
  }
  for (int i = 0; i < nq; ++i) {
    float* out = job.out + ((int64_t)(h * G + i / rows) * job.T + r0 + i % rows) * D;
    const float inv = 1.0f / l[i];
    for (int dv = 0; dv < DV; ++dv) {
      const v16 o = acc[(size_t)i * DV + dv] * inv;
      std::memcpy(out + dv * 16, &o, sizeof(v16));
    }
  }
}

using causal_fn = void (*)(const CausalJob&, int, int);

causal_fn causal_kernel(int D) {
  switch (D) {
    case 16: return causal_block<1>;
    case 32: return causal_block<2>;
    case 64: return causal_block<4>;
    case 128: return causal_block<8>;
    case 256: return causal_block<16>;
    default: return nullptr;
  }
}

void causal_items(void* ctx, int i0, int i1) {
  const auto& job = *static_cast<const CausalJob*>(ctx);
  for (int i = i0; i < i1; ++i) {  // the last blocks (the most keys) first: the pool claims in order
    const int b = job.blocks - 1 - i / job.Hkv, h = i % job.Hkv;
    job.kernel(job, h, b);
  }
}

// q [1, H, T, D], keys / values [1, Hkv, L, D] (float32, L >= T; the rows of a head may be a view
// into a longer cache) -> [1, H, T, D] float32, row t seeing keys 0 .. L - T + t.
mx::array causal_attention(const mx::array& q, const mx::array& keys, const mx::array& values, float scale) {
  if (q.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4 || q.shape(0) != 1 || keys.shape(0) != 1) {
    throw std::invalid_argument("causal_attention: q [1, H, T, D], keys and values [1, Hkv, L, D]");
  }
  check_f32("causal_attention", {&q, &keys, &values});
  const int H = q.shape(1), T = q.shape(2), D = q.shape(3), Hkv = keys.shape(1), L = keys.shape(2);
  if (keys.shape() != values.shape() || keys.shape(3) != D || Hkv < 1 || H % Hkv != 0 || T < 1 || L < T ||
      causal_kernel(D) == nullptr) {
    throw std::invalid_argument("causal_attention: shapes do not match");
  }
  auto body = [scale](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const mx::array &q = ins[0], &k = ins[1], &v = ins[2];
    CausalJob job;
    job.H = q.shape(1), job.T = q.shape(2), job.D = q.shape(3), job.Hkv = k.shape(1), job.L = k.shape(2);
    job.scale = scale;
    job.blocks = (job.T + CA_ROWS - 1) / CA_ROWS;
    job.kernel = causal_kernel(job.D);
    std::vector<float> q_rows, k_rows, v_rows;
    job.q = dense(q, q_rows);
    rows_view(k, k_rows, &job.k, &job.k_head, &job.k_row);
    rows_view(v, v_rows, &job.v, &job.v_head, &job.v_row);
    job.out = outs[0].data<float>();
    run_parallel(causal_items, &job, job.Hkv * job.blocks);
  };
  return cpu_op("CausalAttention", {1, H, T, D}, body, {q, keys, values});
}

// ---- Gated DeltaNet: a token's step, a tree's verify and its commit -----------------------------
//
// What engine/gdn/core.py's OpsCore computes in MLX operations (gates, the short causal conv and its
// SiLU, the q/k L2 norms, the delta rule), here a token or a tree in one operation each. Value head h
// reads key head h / (Hv / Hk), as split_heads repeats them. Float32; the exponentials are libm's.
//
// One arithmetic for all three: a node's conv reads its window (the committed conv rows and its
// ancestors' pre-conv rows, oldest first) tap by tap, and its state is the parent's decayed row by
// row, read at k, corrected by u = beta (v - S k) along k, read at q. A tree keeps every node's
// state; the commit replays the accepted path's (g, u, k) on the committed state by the same
// update. So a verify row's output, and the state committed after it, are bit for bit what plain
// decoding's steps give for the same tokens (tests/engine/test_cpu_gdn.py), where OpsCore's dense
// tree form and its fold round differently from its step.
struct GdnShape {
  int Hk, Hv, Dk, Dv, K;
  int key_dim() const { return Hk * Dk; }
  int conv_dim() const { return 2 * Hk * Dk + Hv * Dv; }
};

// A call's shape from its state [Hv, Dv, Dk] and conv weight [C, K] (zeros where their ranks are
// wrong, which the callers' checks then refuse).
GdnShape gdn_shape_of(const mx::array& S, const mx::array& conv_w, int Hk, int Dk) {
  const bool s3 = S.ndim() == 3;
  return GdnShape{Hk, s3 ? S.shape(0) : 0, Dk, s3 ? S.shape(1) : 0, conv_w.ndim() == 2 ? conv_w.shape(1) : 0};
}

constexpr float L2_EPS = 1e-6f;

// The conv weight [C, K] as [K, C]: conv_row runs tap by tap over every channel.
std::vector<float> taps_first(const GdnShape& sh, const float* conv_w) {
  const int C = sh.conv_dim(), K = sh.K;
  std::vector<float> tap((size_t)K * C);
  for (int c = 0; c < C; ++c) {
    for (int j = 0; j < K; ++j) {
      tap[(int64_t)j * C + c] = conv_w[(int64_t)c * K + j];
    }
  }
  return tap;
}

// A node's post-conv row y [C] from its window's K rows (tap K-1 the node itself) and the weight
// as [K, C] (taps_first): tap by tap over every channel (vectorised over channels), each
// channel's taps summed in order.
void conv_row(const GdnShape& sh, const float* const* window, const float* tap, float* y) {
  const int C = sh.conv_dim(), K = sh.K;
  for (int c = 0; c < C; ++c) {
    y[c] = window[0][c] * tap[c];
  }
  for (int j = 1; j < K; ++j) {
    const float* w = window[j];
    const float* t = tap + (int64_t)j * C;
    for (int c = 0; c < C; ++c) {
      y[c] += w[c] * t[c];
    }
  }
  int c = 0;
  for (; c + 16 <= C; c += 16) {  // SiLU: y / (1 + 2^(-y log2 e))
    const v16 v = *(const v16u*)(y + c);
    *(v16u*)(y + c) = v / (1.0f + exp2_any(-v * LOG2E));
  }
  for (; c < C; ++c) {
    y[c] = y[c] / (1.0f + exp2f(-y[c] * LOG2E));
  }
}

// q and k of a post-conv row, per key head, L2-normalised (q also scaled by Dk^-1/2) -> q, k [Hk, Dk].
void norm_qk(const GdnShape& sh, const float* y, float* q, float* k) {
  const int kd = sh.key_dim();
  const float q_scale = 1.0f / std::sqrt((float)sh.Dk);
  for (int h = 0; h < sh.Hk; ++h) {
    const float* qh = y + h * sh.Dk;
    const float* kh = y + kd + h * sh.Dk;
    float sq = 0.0f, sk = 0.0f;
    for (int d = 0; d < sh.Dk; ++d) {
      sq += qh[d] * qh[d];
      sk += kh[d] * kh[d];
    }
    const float rq = 1.0f / std::sqrt(sq + L2_EPS), rk = 1.0f / std::sqrt(sk + L2_EPS);
    for (int d = 0; d < sh.Dk; ++d) {
      q[h * sh.Dk + d] = qh[d] * rq * q_scale;
      k[h * sh.Dk + d] = kh[d] * rk;
    }
  }
}

// The log-decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) of one head.
inline void gates(float a, float b, float A_log, float dt_bias, float* g, float* beta) {
  const float x = a + dt_bias;
  const float softplus = std::max(x, 0.0f) + log1pf(expf(-std::fabs(x)));
  *g = -expf(A_log) * softplus;
  *beta = 1.0f / (1.0f + expf(-b));
}

// a . b over n floats: 16 lanes of partial sums joined in lanes_sum's fixed tree, then the tail
// (what every dot of the GDN core below runs, so that its step, tree and commit agree bit for bit)
inline float dot_lanes(const float* a, const float* b, int n) {
  v16 acc = {};
  int d = 0;
  for (; d + 16 <= n; d += 16) {
    acc += *(const v16u*)(a + d) * *(const v16u*)(b + d);
  }
  float s = lanes_sum(acc);
  for (; d < n; ++d) {
    s += a[d] * b[d];
  }
  return s;
}

// One head's state after a node: S [Dv, Dk] from the parent's `prev`, decayed by exp(g), corrected
// toward v along k. Writes u = beta (v - decayed S k) [Dv] and o = S q [Dv].
void update_head(int Dv, int Dk, const float* prev, float decay, float beta, const float* k, const float* v,
                 const float* q, float* S, float* u, float* o) {
  if (Dk % 16 == 0 && Dk <= 256) {
    // the row kept in registers between its two passes: the same operations in the same order as
    // below, without reading back what was just stored in other widths (a store-forwarding stall
    // a row, most of a node's time)
    const int V = Dk / 16;
    for (int i = 0; i < Dv; ++i) {
      const float* row = prev + (int64_t)i * Dk;
      float* out = S + (int64_t)i * Dk;
      v16 r[16];
      v16 acc = {};
      for (int t = 0; t < V; ++t) {
        r[t] = decay * *(const v16u*)(row + 16 * t);
        acc += r[t] * *(const v16u*)(k + 16 * t);
      }
      const float delta = beta * (v[i] - lanes_sum(acc));
      u[i] = delta;
      v16 acc2 = {};
      for (int t = 0; t < V; ++t) {
        r[t] += delta * *(const v16u*)(k + 16 * t);
        *(v16u*)(out + 16 * t) = r[t];
        acc2 += r[t] * *(const v16u*)(q + 16 * t);
      }
      o[i] = lanes_sum(acc2);
    }
    return;
  }
  for (int i = 0; i < Dv; ++i) {
    const float* row = prev + (int64_t)i * Dk;
    float* out = S + (int64_t)i * Dk;
    for (int d = 0; d < Dk; ++d) {
      out[d] = decay * row[d];
    }
    const float delta = beta * (v[i] - dot_lanes(out, k, Dk));
    u[i] = delta;
    for (int d = 0; d < Dk; ++d) {
      out[d] += delta * k[d];
    }
    o[i] = dot_lanes(out, q, Dk);
  }
}

// One head's state after a committed node: the update above with the node's u (no read at q).
void replay_head(int Dv, int Dk, float* S, float decay, const float* k, const float* u) {
  for (int i = 0; i < Dv; ++i) {
    float* out = S + (int64_t)i * Dk;
    for (int d = 0; d < Dk; ++d) {
      out[d] = decay * out[d];
    }
    for (int d = 0; d < Dk; ++d) {
      out[d] += u[i] * k[d];
    }
  }
}

// Nodes [N] in topological order (parent[i] < i, -1 for the root's children of the committed
// state): rows x [N, C] pre-conv, a, b [N, Hv], taps [N, K] rows of [conv_state; x] in each node's
// window, the committed conv_state [K-1, C] and S0 [Hv, Dv, Dk] -> o, u [N, Hv, Dv], k [N, Hv, Dk]
// (repeated to the value heads), g [N, Hv]; states [N, Hv, Dv, Dk] scratch. A token is N = 1.
void gdn_nodes(const GdnShape& sh, int N, const float* x, const float* a, const float* b, const int32_t* taps,
               const int32_t* parent, const float* conv_state, const float* S0, const float* conv_w,
               const float* A_log, const float* dt_bias, float* o, float* u_out, float* k_out, float* g_out,
               float* states) {
  const int C = sh.conv_dim(), K = sh.K, kd = sh.key_dim(), rep = sh.Hv / sh.Hk;
  const int64_t state = (int64_t)sh.Hv * sh.Dv * sh.Dk;
  std::vector<float> y(C), q(kd), k(kd);
  std::vector<const float*> window(K);
  const std::vector<float> tap = taps_first(sh, conv_w);
  for (int n = 0; n < N; ++n) {
    for (int j = 0; j < K; ++j) {
      const int r = taps[(int64_t)n * K + j];
      window[j] = r < K - 1 ? conv_state + (int64_t)r * C : x + (int64_t)(r - (K - 1)) * C;
    }
    conv_row(sh, window.data(), tap.data(), y.data());
    norm_qk(sh, y.data(), q.data(), k.data());
    const float* prev_state = parent[n] < 0 ? S0 : states + parent[n] * state;
    for (int h = 0; h < sh.Hv; ++h) {
      float g, beta;
      gates(a[(int64_t)n * sh.Hv + h], b[(int64_t)n * sh.Hv + h], A_log[h], dt_bias[h], &g, &beta);
      g_out[(int64_t)n * sh.Hv + h] = g;
      const float* kh = k.data() + (h / rep) * sh.Dk;
      std::memcpy(k_out + ((int64_t)n * sh.Hv + h) * sh.Dk, kh, sizeof(float) * sh.Dk);
      update_head(sh.Dv, sh.Dk, prev_state + (int64_t)h * sh.Dv * sh.Dk, expf(g), beta, kh,
                  y.data() + 2 * kd + h * sh.Dv, q.data() + (h / rep) * sh.Dk,
                  states + n * state + (int64_t)h * sh.Dv * sh.Dk, u_out + ((int64_t)n * sh.Hv + h) * sh.Dv,
                  o + ((int64_t)n * sh.Hv + h) * sh.Dv);
    }
  }
}

// A tree's verify: x [N, C] pre-conv rows, a, b [N, Hv], taps [N, K] int32 (engine/gdn/ops.py
// tree_conv_taps), conv_state [K-1, C], S0 [Hv, Dv, Dk] (read, never written), conv_w [C, K],
// A_log, dt_bias [Hv] -> [o [N, Hv, Dv], k [N, Hv, Dk], u [N, Hv, Dv], g [N, Hv]]: OpsCore.tree's
// output and TreeRows fields.
std::vector<mx::array> gdn_tree(const mx::array& x, const mx::array& a, const mx::array& b, const mx::array& taps,
                                const mx::array& conv_state, const mx::array& S0, const mx::array& conv_w,
                                const mx::array& A_log, const mx::array& dt_bias, int Hk, int Dk) {
  check_f32("gdn_tree", {&x, &a, &b, &conv_state, &S0, &conv_w, &A_log, &dt_bias});
  const GdnShape sh = gdn_shape_of(S0, conv_w, Hk, Dk);
  const int Hv = sh.Hv, Dv = sh.Dv;
  const int C = sh.conv_dim(), N = x.ndim() == 2 ? x.shape(0) : 0;
  if (Hk < 1 || Hv < 1 || Hv % Hk != 0 || S0.shape(2) != Dk || sh.K < 2 || N < 1 || x.shape(1) != C ||
      a.shape() != mx::Shape{N, Hv} || b.shape() != mx::Shape{N, Hv} || taps.shape() != mx::Shape{N, sh.K} ||
      taps.dtype() != mx::int32 || conv_state.shape() != mx::Shape{sh.K - 1, C} || conv_w.shape(0) != C ||
      A_log.size() != (size_t)Hv || dt_bias.size() != (size_t)Hv) {
    throw std::invalid_argument("gdn_tree: shapes do not match");
  }
  auto body = [sh, N](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const DenseInputs f(ins);
    const int32_t* taps = f.ints(3);
    std::vector<int32_t> parent(N);
    for (int n = 0; n < N; ++n) {  // tap K-2 is the parent's row of [conv_state; x], or a committed one
      const int r = taps[(int64_t)n * sh.K + sh.K - 2] - (sh.K - 1);
      parent[n] = r < 0 || r >= n ? -1 : r;  // (a parent after its child: no tree the engine builds)
    }
    std::vector<float> states((size_t)N * sh.Hv * sh.Dv * sh.Dk);
    gdn_nodes(sh, N, f(0), f(1), f(2), taps, parent.data(), f(4), f(5), f(6), f(7), f(8), outs[0].data<float>(),
              outs[2].data<float>(), outs[1].data<float>(), outs[3].data<float>(), states.data());
  };
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({{N, Hv, Dv}, {N, Hv, Dk}, {N, Hv, Dv}, {N, Hv}},
                                {mx::float32, mx::float32, mx::float32, mx::float32},
                                std::make_shared<CpuPrimitive>(s, "GdnTree", body),
                                {x, a, b, taps, conv_state, S0, conv_w, A_log, dt_bias});
}

// The state after an accepted path: k [N, H, Dk], u [N, H, Dv], g [N, H] (a tree's rows; H may join
// several layers' heads), path int32 [L] node indices root first (-1: padding, skipped), S0
// [H, Dv, Dk] -> S [H, Dv, Dk], by the update a token's step makes.
mx::array gdn_commit(const mx::array& k, const mx::array& u, const mx::array& g, const mx::array& path,
                     const mx::array& S0) {
  check_f32("gdn_commit", {&k, &u, &g, &S0});
  if (S0.ndim() != 3 || k.ndim() != 3 || u.ndim() != 3 || g.ndim() != 2 || path.ndim() != 1 ||
      path.dtype() != mx::int32) {
    throw std::invalid_argument("gdn_commit: shapes do not match");
  }
  const int N = k.shape(0), H = S0.shape(0), Dv = S0.shape(1), Dk = S0.shape(2), L = path.shape(0);
  if (k.shape() != mx::Shape{N, H, Dk} || u.shape() != mx::Shape{N, H, Dv} || g.shape() != mx::Shape{N, H}) {
    throw std::invalid_argument("gdn_commit: shapes do not match");
  }
  auto body = [N, H, Dv, Dk, L](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const DenseInputs in(ins);
    const float *k = in(0), *u = in(1), *g = in(2);
    const int32_t* path = in.ints(3);
    float* S = outs[0].data<float>();
    std::memcpy(S, in(4), sizeof(float) * (size_t)H * Dv * Dk);
    for (int i = 0; i < L; ++i) {
      const int n = path[i];
      if (n < 0 || n >= N) {
        continue;
      }
      for (int h = 0; h < H; ++h) {
        replay_head(Dv, Dk, S + (int64_t)h * Dv * Dk, expf(g[(int64_t)n * H + h]), k + ((int64_t)n * H + h) * Dk,
                    u + ((int64_t)n * H + h) * Dv);
      }
    }
  };
  return cpu_op("GdnCommit", S0.shape(), body, {k, u, g, path, S0});
}

// RMS norm of x's rows over its last axis: y = x * (1 / sqrt(mean(x^2) + eps)) * w, float32, what
// One row's RMS norm: x / rms(x) * w, the sum of squares in 16 lanes joined in a fixed tree.
void rms_row(const float* x, const float* w, int H, float eps, float* y) {
  v16 acc = {};
  int d = 0;
  for (; d + 16 <= H; d += 16) {
    const v16 v = *(const v16u*)(x + d);
    acc += v * v;
  }
  float ss = lanes_sum(acc);
  for (; d < H; ++d) {
    ss += x[d] * x[d];
  }
  const float inv = 1.0f / std::sqrt(ss / (float)H + eps);
  for (int i = 0; i < H; ++i) {
    y[i] = x[i] * inv * w[i];
  }
}

// mx.fast.rms_norm computes on the CPU in three operations (a square, a sum, and the rest
// compiled). A row's sum of squares runs in 16 lanes joined in a fixed tree: the same whatever
// the number of rows.
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  check_f32("rms_norm", {&x, &w});
  if (x.ndim() < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1) || x.size() == 0) {
    throw std::invalid_argument("rms_norm: shapes do not match");
  }
  const int H = x.shape(-1);
  const int64_t rows = (int64_t)x.size() / H;
  auto body = [H, rows, eps](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const DenseInputs in(ins);
    const float *x = in(0), *w = in(1);
    float* y = outs[0].data<float>();
    for (int64_t r = 0; r < rows; ++r) {
      rms_row(x + r * H, w, H, eps, y + r * H);
    }
  };
  return cpu_op("RmsNorm", x.shape(), body, {x, w});
}

// softmax_rows: a softmax over the last axis of float32 rows, each row in three passes over its
// entries (the maximum; 2^((x - max) log2 e) stored and summed in 16 lanes; the division), where
// MLX's operations take five graph passes and a libm power an element (engine/cpu_exp.py): an
// attention's scores in operations, a DFlash block's over a long context or a prefill chunk's,
// ~4.5 ns an element on the dev CPU that way. With a mask [N, L] (the last two axes of x), an entry
// it does not mark weighs 0, as an entry of -inf does; so does any whose weight 2^((x - max) log2 e)
// is below 2^-125 (exp2_lanes' floor, ~1e-38 of the row's largest weight, itself 1: below the
// rounding of the row's sum). A row needs one entry that weighs. Rows run on the shim's threads,
// each row's result from that row alone.
struct SoftmaxJob {
  const float* x;
  const bool* mask;  // [N, L] at strides (mask_row, mask_col), or null
  int64_t mask_row, mask_col;
  float* y;
  int64_t L, N, rows;  // N: the mask's rows (1 without one), dividing x's rows
};

void softmax_row(const float* x, const float* bias, float* y, int64_t L) {
  const int64_t body = L / 16 * 16;
  const v16 none = (v16){} - INFINITY;
  // the row's entries 16 at a time, plus the mask's bias (-inf + x is -inf, 0 + x is x); the tail's
  // lanes past L are -inf
  auto lanes = [&](int64_t j) {
    v16 v = none, b = {};
    if (j < body) {
      v = *(const v16u*)(x + j);
      if (bias != nullptr) {
        b = *(const v16u*)(bias + j);
      }
    } else {
      for (int64_t i = 0; j + i < L; ++i) {
        v[i] = x[j + i];
        b[i] = bias != nullptr ? bias[j + i] : 0.0f;
      }
    }
    return v + b;
  };
  v16 mv = none;
  for (int64_t j = 0; j < L; j += 16) {
    const v16 v = lanes(j);
    mv = v > mv ? v : mv;
  }
  float m = mv[0];
  for (int i = 1; i < 16; ++i) {
    m = std::max(m, mv[i]);
  }
  const v16 floor_ = (v16){} - 125.0f;
  v16 sum = {};
  for (int64_t j = 0; j < L; j += 16) {
    const v16 t = (lanes(j) - m) * LOG2E;
    v16 e = exp2_lanes(t);
    e = t < floor_ ? (v16){} : e;
    sum += e;
    if (j < body) {
      *(v16u*)(y + j) = e;
    } else {
      for (int64_t i = 0; j + i < L; ++i) {
        y[j + i] = e[i];
      }
    }
  }
  const float total = lanes_sum(sum);
  int64_t j = 0;
  for (; j < body; j += 16) {
    *(v16u*)(y + j) = *(const v16u*)(y + j) / total;
  }
  for (; j < L; ++j) {
    y[j] /= total;
  }
}

// Items go mask row by mask row (item i: mask row i / (rows / N), x's row i % (rows / N) of those
// that share it), so a thread turns each of its mask rows into a bias row (0 where marked, -inf
// where not) once and adds it, in cache, to every row of x that shares it.
void softmax_items(void* ctx, int i0, int i1) {
  const auto& job = *static_cast<const SoftmaxJob*>(ctx);
  const int64_t L = job.L, N = job.N, sharing = job.rows / N;
  std::vector<float> bias(job.mask == nullptr ? 0 : L);
  int64_t made = -1;  // the mask row `bias` holds
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t n = i / sharing, r = (i % sharing) * N + n;
    if (job.mask != nullptr && n != made) {
      const bool* m = job.mask + n * job.mask_row;
      for (int64_t j = 0; j < L; ++j) {
        bias[j] = m[j * job.mask_col] ? 0.0f : -INFINITY;
      }
      made = n;
    }
    softmax_row(job.x + r * L, job.mask == nullptr ? nullptr : bias.data(), job.y + r * L, L);
  }
}

mx::array softmax_rows(const mx::array& x, const std::optional<mx::array>& mask) {
  check_f32("softmax_rows", {&x});
  if (x.ndim() < 1 || x.size() == 0 || x.size() / x.shape(-1) > (size_t)INT32_MAX) {
    throw std::invalid_argument("softmax_rows: x must have rows");
  }
  if (mask && (x.ndim() < 2 || mask->ndim() != 2 || mask->dtype() != mx::bool_ || mask->shape(0) != x.shape(-2) ||
               mask->shape(1) != x.shape(-1))) {
    throw std::invalid_argument("softmax_rows: mask must be bool [N, L], x's last two axes");
  }
  const int64_t L = x.shape(-1), N = mask ? x.shape(-2) : 1;
  std::vector<mx::array> inputs = {x};
  if (mask) {
    inputs.push_back(*mask);
  }
  auto body = [L, N](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    std::vector<float> x_rows;
    const int64_t rows = (int64_t)(outs[0].size() / L);
    SoftmaxJob job{dense(ins[0], x_rows), nullptr, 0, 0, outs[0].data<float>(), L, N, rows};
    if (ins.size() > 1) {  // read by its strides
      job.mask = ins[1].data<bool>(), job.mask_row = ins[1].strides(0), job.mask_col = ins[1].strides(1);
    }
    run_parallel(softmax_items, &job, (int)rows);
  };
  return cpu_op("SoftmaxRows", x.shape(), body, std::move(inputs));
}

std::vector<mx::array> gdn_step(const mx::array& qkv, const mx::array& a, const mx::array& b,
                                const mx::array& conv_state, const mx::array& S, const mx::array& conv_w,
                                const mx::array& A_log, const mx::array& dt_bias, int Hk, int Dk) {
  const GdnShape sh = gdn_shape_of(S, conv_w, Hk, Dk);
  const int Hv = sh.Hv, Dv = sh.Dv;
  check_f32("gdn_step", {&qkv, &a, &b, &conv_state, &S, &conv_w, &A_log, &dt_bias});
  const int C = sh.conv_dim();
  if (Hk < 1 || Hv < 1 || Hv % Hk != 0 || S.shape(2) != Dk || sh.K < 2 || qkv.size() != (size_t)C ||
      a.size() != (size_t)Hv || b.size() != (size_t)Hv || conv_state.shape() != mx::Shape{sh.K - 1, C} ||
      conv_w.shape(0) != C || A_log.size() != (size_t)Hv || dt_bias.size() != (size_t)Hv) {
    throw std::invalid_argument("gdn_step: shapes do not match");
  }
  auto body = [sh](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const DenseInputs f(ins);
    // the window: the committed conv rows, then the token (row K-1 of [conv_state; x])
    std::vector<int32_t> taps(sh.K);
    for (int j = 0; j < sh.K; ++j) {
      taps[j] = j;
    }
    const int32_t parent = -1;
    std::vector<float> u((size_t)sh.Hv * sh.Dv), k((size_t)sh.Hv * sh.Dk), g(sh.Hv);
    gdn_nodes(sh, 1, f(0), f(1), f(2), taps.data(), &parent, f(3), f(4), f(5), f(6), f(7), outs[0].data<float>(),
              u.data(), k.data(), g.data(), outs[2].data<float>());
    // the conv state after the token: its last K-2 rows, then the token's pre-conv row
    const int C = sh.conv_dim();
    float* conv = outs[1].data<float>();
    std::memcpy(conv, f(3) + C, sizeof(float) * (size_t)(sh.K - 2) * C);
    std::memcpy(conv + (size_t)(sh.K - 2) * C, f(0), sizeof(float) * C);
  };
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({{1, Hv, Dv}, {sh.K - 1, C}, {Hv, Dv, Dk}}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<CpuPrimitive>(s, "GdnStep", body),
                                {qkv, a, b, conv_state, S, conv_w, A_log, dt_bias});
}

// A prefill's chain of T tokens through a GDN layer's core with the token step's arithmetic
// (gdn_nodes' conv_row, norm_qk, gates and update_head), token after token: the state after a
// prefilled chain is the one T decode steps leave, bit for bit, where MLX's chunked dense form
// (engine/gdn/ops.py chunked) rounds otherwise, and costs ~30 graph operations every 32 tokens. Two
// phases on the shim's threads: every token's conv row, q, k and gates (tokens apart), then the
// recurrence (heads apart, each head's state updated in place).
struct ChainJob {
  GdnShape sh;
  int T;
  const float *x, *a, *b, *conv_state, *A_log, *dt_bias;
  const float* tap;  // the conv weight as [K, C] (taps_first)
  float* y;          // [T, C] post-conv rows
  float *q, *k;      // [T, key_dim]
  float *g, *beta;   // [T, Hv]
  float* S;          // [Hv, Dv, Dk]: the state, in place
  float* o;          // [T, Hv, Dv]
};

void chain_rows(void* ctx, int n0, int n1) {
  const auto& j = *static_cast<const ChainJob*>(ctx);
  const int C = j.sh.conv_dim(), K = j.sh.K, kd = j.sh.key_dim(), Hv = j.sh.Hv;
  std::vector<const float*> window(K);
  for (int n = n0; n < n1; ++n) {
    for (int t = 0; t < K; ++t) {  // token n's window: rows n .. n + K - 1 of [conv_state; x]
      const int r = n + t;
      window[t] = r < K - 1 ? j.conv_state + (int64_t)r * C : j.x + (int64_t)(r - (K - 1)) * C;
    }
    float* y = j.y + (int64_t)n * C;
    conv_row(j.sh, window.data(), j.tap, y);
    norm_qk(j.sh, y, j.q + (int64_t)n * kd, j.k + (int64_t)n * kd);
    for (int h = 0; h < Hv; ++h) {
      const int64_t i = (int64_t)n * Hv + h;
      gates(j.a[i], j.b[i], j.A_log[h], j.dt_bias[h], j.g + i, j.beta + i);
    }
  }
}

void chain_heads(void* ctx, int h0, int h1) {
  const auto& j = *static_cast<const ChainJob*>(ctx);
  const GdnShape& sh = j.sh;
  const int C = sh.conv_dim(), kd = sh.key_dim(), rep = sh.Hv / sh.Hk;
  std::vector<float> u(sh.Dv);
  for (int h = h0; h < h1; ++h) {
    float* S = j.S + (int64_t)h * sh.Dv * sh.Dk;
    for (int n = 0; n < j.T; ++n) {
      const int64_t i = (int64_t)n * sh.Hv + h;
      update_head(sh.Dv, sh.Dk, S, expf(j.g[i]), j.beta[i], j.k + (int64_t)n * kd + (h / rep) * sh.Dk,
                  j.y + (int64_t)n * C + 2 * kd + h * sh.Dv, j.q + (int64_t)n * kd + (h / rep) * sh.Dk, S, u.data(),
                  j.o + i * sh.Dv);
    }
  }
}

// qkv [T, C] pre-conv rows, a, b [T, Hv], conv_state [K-1, C], S [Hv, Dv, Dk], conv_w [C, K],
// A_log, dt_bias [Hv] -> [o [T, Hv, Dv], conv state after the chain, S after it]: OpsCore.chain's.
std::vector<mx::array> gdn_chain(const mx::array& qkv, const mx::array& a, const mx::array& b,
                                 const mx::array& conv_state, const mx::array& S, const mx::array& conv_w,
                                 const mx::array& A_log, const mx::array& dt_bias, int Hk, int Dk) {
  const GdnShape sh = gdn_shape_of(S, conv_w, Hk, Dk);
  const int Hv = sh.Hv, Dv = sh.Dv;
  check_f32("gdn_chain", {&qkv, &a, &b, &conv_state, &S, &conv_w, &A_log, &dt_bias});
  const int C = sh.conv_dim(), T = qkv.ndim() == 2 ? qkv.shape(0) : 0;
  if (Hk < 1 || Hv < 1 || Hv % Hk != 0 || S.shape(2) != Dk || sh.K < 2 || T < 1 || qkv.shape(1) != C ||
      a.shape() != mx::Shape{T, Hv} || b.shape() != mx::Shape{T, Hv} || conv_state.shape() != mx::Shape{sh.K - 1, C} ||
      conv_w.shape(0) != C || A_log.size() != (size_t)Hv || dt_bias.size() != (size_t)Hv) {
    throw std::invalid_argument("gdn_chain: shapes do not match");
  }
  auto body = [sh, T](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const DenseInputs f(ins);
    const int C = sh.conv_dim(), kd = sh.key_dim(), K = sh.K;
    const std::vector<float> tap = taps_first(sh, f(5));
    std::vector<float> y((size_t)T * C), q((size_t)T * kd), k((size_t)T * kd), g((size_t)T * sh.Hv),
        beta((size_t)T * sh.Hv);
    float* state = outs[2].data<float>();
    std::memcpy(state, f(4), sizeof(float) * (size_t)sh.Hv * sh.Dv * sh.Dk);
    ChainJob job{sh, T, f(0), f(1), f(2), f(3), f(6), f(7), tap.data(), y.data(), q.data(), k.data(), g.data(),
                 beta.data(), state, outs[0].data<float>()};
    run_parallel(chain_rows, &job, T);
    run_parallel(chain_heads, &job, sh.Hv);
    float* conv = outs[1].data<float>();  // rows T .. T + K - 2 of [conv_state; x]
    for (int i = 0; i < K - 1; ++i) {
      const int r = T + i;
      const float* row = r < K - 1 ? f(3) + (int64_t)r * C : f(0) + (int64_t)(r - (K - 1)) * C;
      std::memcpy(conv + (int64_t)i * C, row, sizeof(float) * C);
    }
  };
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({{T, Hv, Dv}, {sh.K - 1, C}, {Hv, Dv, Dk}}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<CpuPrimitive>(s, "GdnChain", body),
                                {qkv, a, b, conv_state, S, conv_w, A_log, dt_bias});
}

// ---- RoPE ------------------------------------------------------------------------------------
//
// MLX's rope on the CPU is no kernel but its fallback's graph: ~15 nodes compiled (positions,
// inverse frequencies through an exponential, the angles, cos, sin, two products and a sum or
// difference a half), built anew on every call of every attention layer. Here one operation with
// the fallback's formula (inverse frequency i = base^(-i / half), angle = position * that) but the
// angles, their cos and sin in double: MLX takes the angle in float32, which at position 4,000 is
// off by up to ~5e-4 radians, so this rotation is the more exact of the two and differs from MLX's
// by MLX's error. The halves' products are rounded apart from their sum (built with
// -ffp-contract=off), and a row's rotation depends only on its position: a verify row and the
// decode step at the same position are rotated alike (tests/engine/test_cpu_rope.py).

// cos and sin of the `half` angles at position pos.
void rope_angles(int pos, int half, float base, float* c, float* s) {
  const double step = std::log((double)base) / half;
  for (int i = 0; i < half; ++i) {
    const double theta = (double)pos * std::exp(-(double)i * step);
    c[i] = (float)std::cos(theta), s[i] = (float)std::sin(theta);
  }
}

// x[i], x[i + half] rotated by angle i, for i < half (the rest of a head's row left as it is).
void rotate_half(float* x, int half, const float* c, const float* s) {
  for (int i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] - b * s[i];
    x[i + half] = a * s[i] + b * c[i];
  }
}

// x [B, H, T, D] float32 rotated over its first `dims` of D: row t at position offset + t, or at
// positions[t] (int32 [T]: a verify's rows) -> [B, H, T, D].
mx::array rope(const mx::array& x, int dims, float base, const mx::array& offset,
               const std::optional<mx::array>& positions) {
  check_f32("rope", {&x});
  const int T = x.ndim() == 4 ? x.shape(2) : 0, D = x.ndim() == 4 ? x.shape(3) : 0;
  if (x.ndim() != 4 || dims < 2 || dims % 2 != 0 || dims > D || offset.size() != 1 || offset.dtype() != mx::int32 ||
      (positions && (positions->dtype() != mx::int32 || positions->size() != (size_t)T))) {
    throw std::invalid_argument("rope: x [B, H, T, D] float32, dims even and <= D, int32 offset or positions [T]");
  }
  std::vector<mx::array> inputs = {x, offset};
  if (positions) {
    inputs.push_back(*positions);
  }
  auto body = [dims, base](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const mx::array& x = ins[0];
    const int rows = x.shape(0) * x.shape(1), T = x.shape(2), D = x.shape(3), half = dims / 2;
    std::vector<float> tmp;
    std::vector<int32_t> pos_tmp;
    const float* in = dense(x, tmp);
    const int32_t* pos = ins.size() > 2 ? dense_as<int32_t>(ins[2], pos_tmp) : nullptr;
    const int32_t offset = ins[1].data<int32_t>()[0];
    std::vector<float> c((size_t)T * half), sn((size_t)T * half);  // each row's angles, for every head
    for (int t = 0; t < T; ++t) {
      rope_angles(pos != nullptr ? pos[t] : offset + t, half, base, c.data() + (size_t)t * half,
                  sn.data() + (size_t)t * half);
    }
    float* out = outs[0].data<float>();
    std::memcpy(out, in, sizeof(float) * (size_t)rows * T * D);
    for (int r = 0; r < rows; ++r) {
      for (int t = 0; t < T; ++t) {
        rotate_half(out + ((size_t)r * T + t) * D, half, c.data() + (size_t)t * half, sn.data() + (size_t)t * half);
      }
    }
  };
  return cpu_op("Rope", x.shape(), body, std::move(inputs));
}

// ---- the MTP head's chain draft: every depth in one operation -----------------------------------
//
// engine/drafters/mtp.py drafts a chain depth by depth: a depth's read (the target's lm_head over
// the draft vocabulary, its top-k and log-probabilities) and, for the next depth, the head's row
// (engine/models/mtp.py draft_row): ~95 graph nodes a depth, ~0.29 ms on the dev CPU of which the
// products are ~0.1, and a sync a depth for the stop rule. Here the whole chain is one operation:
// the same arithmetic row by row (the products through cblas_sgemm as MLX's matmul calls it, so
// the GEMV shim's panel kernel where the weight is registered: the same sums as the ops path's
// products), the stop rule applied between depths. What comes back is what the drafter's loop
// reads: the top-k ids and log-probabilities of each depth it reached, and how many.
//
// It can also take the head's catch-up first (engine/models/mtp.py MTPHead.append: the rows of the
// positions committed since the last draft, ~50 graph nodes): their K/V come back for the drafter
// to write into the head's cache, with the last row's output, from which the chain drafts.

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                          int);

// out [M, N] = A [M, K] times W [N, K] transposed: as MLX multiplies x @ W.T on the CPU
// (cblas_sgemm, B transposed), where a BLAS is in the process; else a plain loop.
void rows_times(const float* A, const float* W, int M, int N, int K, float* out) {
  static sgemm_fn fn = reinterpret_cast<sgemm_fn>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  if (fn != nullptr) {
    fn(101, 111, 112, M, N, K, 1.0f, A, K, W, K, 0.0f, out, N);  // row-major, A as is, B transposed
    return;
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        acc += A[m * K + k] * W[n * K + k];
      }
      out[m * N + n] = acc;
    }
  }
}

inline void row_times(const float* x, const float* W, int N, int K, float* out) { rows_times(x, W, 1, N, K, out); }

// ---- a layer's MLP block ----------------------------------------------------------------------
//
// The second half of a decoder layer, h = x + out (the mixer's output), then h + down(SiLU(gate(n))
// * up(n)) with n = h's RMS norm: in MLX's operations an add, a norm, three products, the compiled
// SiLU-and-product and an add, with the views around them (~11 graph nodes a layer). Here one
// operation over a few rows (a decode step, a verify), its products through cblas_sgemm as MLX
// calls it (the GEMV shim's kernels: batch invariant), every other step row by row, the SiLU in
// the GDN conv's form (2^ in 16 lanes). So a row's result does not depend on the other rows
// (tests/engine/test_cpu_mlp.py).

// y = h + down(SiLU(gate(n)) * up(n)) for M rows h [M, H], n = h's RMS norm (norm_w, eps); gate,
// up [I, H], down [H, I]. y may be h.
void mlp_rows(const float* h, int M, int H, int I, const float* norm_w, const float* gate_w, const float* up_w,
              const float* down_w, float eps, float* y) {
  std::vector<float> n((size_t)M * H), g((size_t)M * I), u((size_t)M * I), d((size_t)M * H);
  for (int r = 0; r < M; ++r) {
    rms_row(h + (int64_t)r * H, norm_w, H, eps, n.data() + (int64_t)r * H);
  }
  rows_times(n.data(), gate_w, M, I, H, g.data());
  rows_times(n.data(), up_w, M, I, H, u.data());
  size_t i = 0;
  for (; i + 16 <= g.size(); i += 16) {  // SiLU(gate) * up
    const v16 v = *(const v16u*)(g.data() + i);
    *(v16u*)(g.data() + i) = v / (1.0f + exp2_any(-v * LOG2E)) * *(const v16u*)(u.data() + i);
  }
  for (; i < g.size(); ++i) {
    g[i] = g[i] / (1.0f + exp2f(-g[i] * LOG2E)) * u[i];
  }
  rows_times(g.data(), down_w, M, H, I, d.data());
  for (size_t j = 0; j < d.size(); ++j) {
    y[j] = h[j] + d[j];
  }
}

// x, out [..., H] (rows of the stream and the mixer's output), norm_w [H], gate_w, up_w [I, H],
// down_w [H, I] -> [..., H].
mx::array mlp_block(const mx::array& x, const mx::array& out, const mx::array& norm_w, const mx::array& gate_w,
                    const mx::array& up_w, const mx::array& down_w, float eps) {
  check_f32("mlp_block", {&x, &out, &norm_w, &gate_w, &up_w, &down_w});
  const int H = x.ndim() >= 1 ? x.shape(-1) : 0, I = gate_w.ndim() == 2 ? gate_w.shape(0) : 0;
  const auto is = [](const mx::array& a, std::initializer_list<int> shape) { return a.shape() == mx::Shape(shape); };
  if (H < 1 || I < 1 || x.size() == 0 || out.shape() != x.shape() || !is(norm_w, {H}) || !is(gate_w, {I, H}) ||
      !is(up_w, {I, H}) || !is(down_w, {H, I})) {
    throw std::invalid_argument("mlp_block: shapes do not match");
  }
  const int M = (int)(x.size() / H);
  auto body = [H, I, M, eps](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const DenseInputs in(ins);
    const float *x = in(0), *o = in(1), *norm_w = in(2), *gate_w = in(3), *up_w = in(4), *down_w = in(5);
    std::vector<float> h((size_t)M * H);
    for (size_t i = 0; i < h.size(); ++i) {
      h[i] = x[i] + o[i];
    }
    mlp_rows(h.data(), M, H, I, norm_w, gate_w, up_w, down_w, eps, outs[0].data<float>());
  };
  return cpu_op("MlpBlock", x.shape(), body, {x, out, norm_w, gate_w, up_w, down_w});
}

// ---- a norm and the products that read it ---------------------------------------------------
//
// A layer's mixer reads its normed input through several products (a GDN layer's qkv, z, b and a
// projections; attention's q, k and v): in MLX's operations a norm, a product each and their views.
// Here one operation: the rows normed as rms_norm does (or taken as they are), then each product
// through cblas_sgemm as MLX's matmul calls it, so every output is bitwise what the operations give
// (tests/engine/test_cpu_products.py).

// x [M, K], norm_w [K] or none, weights [N_i, K] -> [M, N_i] each.
std::vector<mx::array> norm_products(const mx::array& x, const std::optional<mx::array>& norm_w, float eps,
                                     const std::vector<mx::array>& weights) {
  check_f32("norm_products", {&x});
  const int M = x.ndim() == 2 ? x.shape(0) : 0, K = x.ndim() == 2 ? x.shape(1) : 0;
  bool ok = M >= 1 && K >= 1 && !weights.empty() && (!norm_w || (norm_w->dtype() == mx::float32 &&
                                                                  norm_w->shape() == mx::Shape{K}));
  std::vector<mx::Shape> shapes;
  for (const auto& w : weights) {
    ok = ok && w.dtype() == mx::float32 && w.ndim() == 2 && w.shape(1) == K && w.shape(0) >= 1;
    shapes.push_back({M, ok ? (int)w.shape(0) : 0});
  }
  if (!ok) {
    throw std::invalid_argument("norm_products: x [M, K] float32, norm [K] or none, weights [N, K] float32");
  }
  std::vector<mx::array> inputs = {x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  if (norm_w) {
    inputs.push_back(*norm_w);
  }
  const bool normed = bool(norm_w);
  const int n_weights = (int)weights.size();
  auto body = [M, K, eps, normed, n_weights](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    std::vector<float> tmp, rows;
    const float* a = dense(ins[0], tmp);
    if (normed) {
      std::vector<float> w_tmp;
      const float* w = dense(ins[1 + n_weights], w_tmp);
      rows.resize((size_t)M * K);
      for (int r = 0; r < M; ++r) {
        rms_row(a + (int64_t)r * K, w, K, eps, rows.data() + (int64_t)r * K);
      }
      a = rows.data();
    }
    for (int i = 0; i < n_weights; ++i) {
      std::vector<float> w_tmp;  // in place where contiguous: the registered weight's own address
      rows_times(a, dense(ins[1 + i], w_tmp), M, outs[i].shape(1), K, outs[i].data<float>());
    }
  };
  std::vector<mx::Dtype> dtypes(weights.size(), mx::float32);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<CpuPrimitive>(mx::default_stream(mx::Device::cpu), "NormProducts", body),
                                std::move(inputs));
}

inline float sigmoid1(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The head's shape and where its inputs are (MtpChain's inputs, in order: see mtp_chain).
struct MtpHead {
  int H, heads, kv_heads, D, I, rope_dims, vocab;  // vocab: the lm_head's rows
  float eps, scale, rope_base;
  const float *embed, *lm, *pre_e, *pre_h, *fc, *in_norm, *wq, *wk, *wv, *q_norm, *k_norm, *wo, *post_norm, *gate,
      *up, *down, *final_norm;
  const int32_t* vocab_ids;  // the lm_head's rows' token ids, or null: row i is token i
  // the cache's committed K/V (rows_view), then the rows this operation adds: the catch-up's, then
  // the draft's
  const float *keys, *values;
  int64_t k_head, k_row, v_head, v_row;
  int length;
  std::vector<float> sk, sv;  // [kv_heads, S, D]
  int S;
};

// A row's RoPE angles (rope's arithmetic, above), taken once for all its heads.
struct RowAngles {
  std::vector<float> c, s;
  RowAngles(const MtpHead& m, int pos) : c(m.rope_dims / 2), s(m.rope_dims / 2) {
    rope_angles(pos, m.rope_dims / 2, m.rope_base, c.data(), s.data());
  }
  void rotate(float* head_row) const { rotate_half(head_row, (int)c.size(), c.data(), s.data()); }
};

// The fc input of a row: [pre-fc norm of the token's embedding; pre-fc norm of the hidden state]
// -> fc -> x [H].
void fc_in(const MtpHead& m, int token, const float* hidden, float* x) {
  std::vector<float> cat(2 * m.H);
  rms_row(m.embed + (int64_t)token * m.H, m.pre_e, m.H, m.eps, cat.data());
  rms_row(hidden, m.pre_h, m.H, m.eps, cat.data() + m.H);
  row_times(cat.data(), m.fc, m.H, 2 * m.H, x);
}

// A row's K/V from its fc output x (input norm, projections, k norm, RoPE) into row s of the
// head's own rows (position length + s); the query-and-gate projection into qg where given.
void row_kv(MtpHead& m, const float* x, int s, float* n, float* qg) {
  const int H = m.H, D = m.D, KD = m.kv_heads * D;
  const RowAngles angles(m, m.length + s);
  std::vector<float> k(KD), v(KD);
  rms_row(x, m.in_norm, H, m.eps, n);
  if (qg != nullptr) {
    row_times(n, m.wq, 2 * m.heads * D, H, qg);
  }
  row_times(n, m.wk, KD, H, k.data());
  row_times(n, m.wv, KD, H, v.data());
  for (int hd = 0; hd < m.kv_heads; ++hd) {
    float* kr = m.sk.data() + ((int64_t)hd * m.S + s) * D;
    rms_row(k.data() + (int64_t)hd * D, m.k_norm, D, m.eps, kr);
    angles.rotate(kr);
    std::memcpy(m.sv.data() + ((int64_t)hd * m.S + s) * D, v.data() + (int64_t)hd * D, sizeof(float) * D);
  }
}

// The rest of the head's row after its K/V (row s of the head's own rows): the attention over the
// cache's committed rows and the own rows 0..s, the output gate and projection, the MLP block
// (mlp_block's arithmetic) -> y_out [H] (final-normed).
void row_rest(MtpHead& m, const float* x, const float* qg, int s, float* y_out) {
  const int H = m.H, D = m.D, QD = m.heads * D;
  const RowAngles angles(m, m.length + s);
  std::vector<float> q(QD), att(QD), h(H), mo(H);
  for (int hd = 0; hd < m.heads; ++hd) {  // per head [query | gate]: the query normed and rotated
    rms_row(qg + (int64_t)hd * 2 * D, m.q_norm, D, m.eps, q.data() + (int64_t)hd * D);
    angles.rotate(q.data() + (int64_t)hd * D);
  }
  AttentionJob job;  // one row over the committed rows and the own rows 0..s
  job.H = m.heads, job.N = 1, job.D = D, job.Hkv = m.kv_heads, job.scale = m.scale, job.prefix = m.length;
  job.q = q.data();
  job.k = m.keys, job.v = m.values;
  job.k_head = m.k_head, job.k_row = m.k_row, job.v_head = m.v_head, job.v_row = m.v_row;
  job.k2 = m.sk.data(), job.v2 = m.sv.data();
  job.k2_head = job.v2_head = (int64_t)m.S * D, job.k2_row = job.v2_row = D;
  job.out = att.data();
  job.tree_keys.assign(1, std::vector<int>());
  for (int t = 0; t <= s; ++t) {
    job.tree_keys[0].push_back(t);
  }
  run_attention(job);
  for (int hd = 0; hd < m.heads; ++hd) {  // the output gate
    for (int d = 0; d < D; ++d) {
      att[(int64_t)hd * D + d] *= sigmoid1(qg[(int64_t)hd * 2 * D + D + d]);
    }
  }
  row_times(att.data(), m.wo, H, QD, mo.data());
  for (int i = 0; i < H; ++i) {
    h[i] = x[i] + mo[i];
  }
  mlp_rows(h.data(), 1, H, m.I, m.post_norm, m.gate, m.up, m.down, m.eps, h.data());
  rms_row(h.data(), m.final_norm, H, m.eps, y_out);
}

// The head's whole row for `token` with y as its hidden state, at row s of its own rows (position
// length + s) -> y_out [H].
void mtp_row(MtpHead& m, int token, const float* y, int s, float* y_out) {
  std::vector<float> x(m.H), n(m.H), qg(2 * m.heads * m.D);
  fc_in(m, token, y, x.data());
  row_kv(m, x.data(), s, n.data(), qg.data());
  row_rest(m, x.data(), qg.data(), s, y_out);
}

// How a chain token is guessed where the target samples (mtp_chain's `uniforms`): the request's
// temperature, top-k (at least 1: the rows the head ranks) and top-p, and this depth's uniform.
struct DraftDraw {
  float temperature, top_p, u;
  int top_k;
};

// The token a seeded draw at uniform u takes from the head's top-n rows `order` (most likely first):
// p = exp((l - l_max) / t), the top-p cut over them best first, then the running sum in the target's
// vocabulary order (token ids) and the first token where it passes u times the total. The target
// draws its token at the same position with the same u in that order, so where the head's
// distribution is close to the target's the two coincide far more often than the target's draw
// equals the head's argmax. A guess, not the target's arithmetic: the accept rule decides.
int coupled_row(const MtpHead& m, const std::vector<float>& logits, const std::vector<int>& order, int n,
                const DraftDraw& d) {
  std::vector<double> p(n);
  double total = 0.0;
  for (int j = 0; j < n; ++j) {
    p[j] = std::exp(((double)logits[order[j]] - (double)logits[order[0]]) / (double)d.temperature);
    total += p[j];
  }
  int kept = n;
  if (d.top_p < 1.0f) {
    double before = 0.0;
    for (int j = 0; j < n; ++j) {
      if (before >= d.top_p * total) {
        kept = j;
        break;
      }
      before += p[j];
    }
  }
  kept = std::max(kept, 1);  // the most likely row at least, whatever the cut (a top_p of 0)
  std::vector<std::pair<int32_t, int>> by_id(kept);  // (token id, rank)
  for (int j = 0; j < kept; ++j) {
    by_id[j] = {m.vocab_ids != nullptr ? m.vocab_ids[order[j]] : order[j], j};
  }
  std::sort(by_id.begin(), by_id.end());
  double mass = 0.0;
  for (int j = 0; j < kept; ++j) {
    mass += p[j];
  }
  const double target = (double)d.u * mass;
  double run = 0.0;
  for (const auto& [id, j] : by_id) {
    run += p[j];
    if (run > target) {
      return order[j];
    }
  }
  return order[by_id.back().second];
}

// A depth's read of the head's output y: the lm_head's logits, their top k (most likely first; a
// tie to the lower row, as MLX's argmax) as token ids and log-probabilities under all the rows
// (logsumexp in double) -> the argmax's token id. With `draw`, the drawn token (coupled_row) comes
// first instead, the others after it in order, and its id is returned.
int read_depth(const MtpHead& m, const float* y, int k, std::vector<float>& logits, int32_t* ids, float* logp,
               const DraftDraw* draw = nullptr) {
  logits.resize(m.vocab);
  row_times(y, m.lm, m.vocab, m.H, logits.data());
  float top = logits[0];
  for (float l : logits) {
    top = std::max(top, l);
  }
  double sum = 0.0;
  for (float l : logits) {
    sum += std::exp((double)l - (double)top);
  }
  const float lse = (float)((double)top + std::log(sum));
  std::vector<int> order(m.vocab);
  for (int i = 0; i < m.vocab; ++i) {
    order[i] = i;
  }
  const int drawn = draw == nullptr ? 0 : std::min(draw->top_k, m.vocab);  // the rows a draw ranks
  const int n = std::max(k, drawn);
  std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  if (draw != nullptr) {  // the drawn row first, the others after it in order
    const int row = coupled_row(m, logits, order, drawn, *draw);
    const auto at = std::find(order.begin(), order.begin() + n, row);
    std::rotate(order.begin(), at, at + 1);
  }
  for (int i = 0; i < k; ++i) {
    ids[i] = m.vocab_ids != nullptr ? m.vocab_ids[order[i]] : order[i];
    logp[i] = logits[order[i]] - lse;
  }
  return ids[0];
}

// y [H] (the head's output of the last committed row), embed [V, H], lm [N, H] (the lm_head's
// rows), vocab_ids int32 [N] or none, w: the head's 15 weights (pre-fc norms of the embedding and
// the hidden state, fc, input norm, q / k / v projections, q and k norms, o projection,
// post-attention norm, MLP gate / up / down, final norm), keys / values [1, Hkv, cap, D] with
// rows [0, length) committed, length int32 [1] -> (ids int32 [depth, k], logp float32 [depth, k],
// depths int32 [1]): the depths drafted, each from the argmax of the one before, until `depth` or
// until the top-1 path's log-probability falls below log_min_path (rows past it zero).
//
// With rows_ids int32 [T] and rows_hidden [T, H] (the catch-up's tokens x_{i+1} and the target's
// hidden states h_i of T newly committed positions from `length` on), those rows come first: y is
// then the last of them's output, and three more outputs come back: their keys and values
// [1, Hkv, T, D] (for the cache) and that output [1, 1, H].
//
// With uniforms float32 [>= depth] (where the target samples), each depth's chain token is the one
// a draw at that depth's uniform takes from the head's distribution under draw_temperature,
// draw_top_k and draw_top_p (read_depth's `draw`: coupled_row), not the argmax; the stop rule then
// follows the drawn path.
std::vector<mx::array> mtp_chain(const mx::array& y, const mx::array& embed, const mx::array& lm,
                                 const std::optional<mx::array>& vocab_ids, const std::vector<mx::array>& w,
                                 const mx::array& keys, const mx::array& values, const mx::array& length,
                                 const std::optional<mx::array>& rows_ids, const std::optional<mx::array>& rows_hidden,
                                 int heads, int head_dim, int rope_dims, float rope_base, float eps, float scale, int k,
                                 int depth, float log_min_path, const std::optional<mx::array>& uniforms,
                                 float draw_temperature, int draw_top_k, float draw_top_p) {
  if (w.size() != 15) {
    throw std::invalid_argument("mtp_chain: 15 weights");
  }
  check_f32("mtp_chain", {&y, &embed, &lm, &keys, &values});
  for (const auto& a : w) {
    check_f32("mtp_chain", {&a});
  }
  const int H = embed.ndim() == 2 ? embed.shape(1) : 0, D = head_dim, N = lm.ndim() == 2 ? lm.shape(0) : 0;
  const int Hkv = keys.ndim() == 4 ? keys.shape(1) : 0, I = w[11].ndim() == 2 ? w[11].shape(0) : 0;
  const int V = embed.ndim() == 2 ? embed.shape(0) : 0;
  const int T = rows_ids ? (int)rows_ids->size() : 0;
  const auto is = [](const mx::array& a, std::initializer_list<int> shape) { return a.shape() == mx::Shape(shape); };
  if (H < 1 || heads < 1 || Hkv < 1 || heads % Hkv != 0 || D < 1 || rope_dims < 0 || rope_dims > D ||
      rope_dims % 2 != 0 || N < 1 || k < 1 || k > N || depth < 1 || (!rows_ids && (int)y.size() != H) ||
      !is(lm, {N, H}) || !is(keys, {1, Hkv, keys.shape(2), D}) || values.shape() != keys.shape() ||
      length.size() != 1 || length.dtype() != mx::int32 || !is(w[0], {H}) || !is(w[1], {H}) ||
      !is(w[2], {H, 2 * H}) || !is(w[3], {H}) || !is(w[4], {2 * heads * D, H}) || !is(w[5], {Hkv * D, H}) ||
      !is(w[6], {Hkv * D, H}) || !is(w[7], {D}) || !is(w[8], {D}) || !is(w[9], {H, heads * D}) ||
      !is(w[10], {H}) || !is(w[12], {I, H}) || !is(w[13], {H, I}) || !is(w[14], {H}) || I < 1 ||
      (vocab_ids && (vocab_ids->dtype() != mx::int32 || !is(*vocab_ids, {N}))) || chunk_kernel(heads / Hkv, D) == nullptr ||
      bool(rows_ids) != bool(rows_hidden) ||
      (rows_ids && (T < 1 || rows_ids->dtype() != mx::int32 || rows_ids->ndim() != 1 ||
                    rows_hidden->dtype() != mx::float32 || !is(*rows_hidden, {T, H}))) ||
      (uniforms && (uniforms->dtype() != mx::float32 || (int)uniforms->size() < depth || !(draw_temperature > 0.0f) ||
                    draw_top_k < 1))) {
    throw std::invalid_argument("mtp_chain: shapes do not match");
  }
  std::vector<mx::array> inputs = {y, embed, lm, keys, values, length};
  inputs.insert(inputs.end(), w.begin(), w.end());
  inputs.push_back(vocab_ids ? *vocab_ids : mx::array(0));  // a placeholder where none
  if (rows_ids) {
    inputs.push_back(*rows_ids);
    inputs.push_back(*rows_hidden);
  }
  const int u_at = uniforms ? (int)inputs.size() : -1;
  if (uniforms) {
    inputs.push_back(*uniforms);
  }
  const bool has_vocab = bool(vocab_ids);
  auto body = [=](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    std::vector<std::vector<float>> tmp(ins.size());
    const auto f = [&](int i) { return dense(ins[i], tmp[i]); };
    MtpHead m{H, heads, Hkv, D, I, rope_dims, N, eps, scale, rope_base};
    m.embed = f(1), m.lm = f(2);
    const float** weights[15] = {&m.pre_e, &m.pre_h, &m.fc, &m.in_norm, &m.wq, &m.wk, &m.wv, &m.q_norm,
                                 &m.k_norm, &m.wo, &m.post_norm, &m.gate, &m.up, &m.down, &m.final_norm};
    for (int i = 0; i < 15; ++i) {
      *weights[i] = f(6 + i);
    }
    std::vector<int32_t> id_rows, row_tokens;
    m.vocab_ids = has_vocab ? dense_as<int32_t>(ins[21], id_rows) : nullptr;
    std::vector<float> kv_tmp[2];
    rows_view(ins[3], kv_tmp[0], &m.keys, &m.k_head, &m.k_row);
    rows_view(ins[4], kv_tmp[1], &m.values, &m.v_head, &m.v_row);
    m.length = std::clamp(ins[5].data<int32_t>()[0], 0, (int)ins[3].shape(2));
    m.S = T + depth;  // the head's own rows: the catch-up's, then the draft's
    m.sk.assign((size_t)Hkv * m.S * D, 0.0f), m.sv.assign((size_t)Hkv * m.S * D, 0.0f);
    std::vector<float> cur(H), next(H), logits;
    if (T > 0) {  // the catch-up: every row's K/V, the last row whole
      const int32_t* tokens = dense_as<int32_t>(ins[22], row_tokens);
      const float* hidden = f(23);
      std::vector<float> x(H), n(H), qg(2 * heads * D);
      for (int t = 0; t < T; ++t) {
        const int token = std::clamp(tokens[t], 0, V - 1);
        fc_in(m, token, hidden + (int64_t)t * H, x.data());
        row_kv(m, x.data(), t, n.data(), t + 1 == T ? qg.data() : nullptr);
      }
      row_rest(m, x.data(), qg.data(), T - 1, cur.data());
      for (int hd = 0; hd < Hkv; ++hd) {  // the catch-up's K/V rows out, [1, Hkv, T, D]
        std::memcpy(outs[3].data<float>() + (int64_t)hd * T * D, m.sk.data() + (int64_t)hd * m.S * D,
                    sizeof(float) * T * D);
        std::memcpy(outs[4].data<float>() + (int64_t)hd * T * D, m.sv.data() + (int64_t)hd * m.S * D,
                    sizeof(float) * T * D);
      }
      std::memcpy(outs[5].data<float>(), cur.data(), sizeof(float) * H);
    } else {
      std::memcpy(cur.data(), f(0), sizeof(float) * H);
    }
    int32_t* ids = outs[0].data<int32_t>();
    float* logp = outs[1].data<float>();
    std::fill(ids, ids + (size_t)depth * k, 0);
    std::fill(logp, logp + (size_t)depth * k, 0.0f);
    double path = 0.0;
    int reached = 0;
    std::vector<float> u_tmp;
    const float* us = u_at >= 0 ? dense(ins[u_at], u_tmp) : nullptr;
    for (int d = 0; d < depth; ++d) {
      const DraftDraw draw{draw_temperature, draw_top_p, us != nullptr ? us[d] : 0.0f, draw_top_k};
      const int token = read_depth(m, cur.data(), k, logits, ids + (size_t)d * k, logp + (size_t)d * k,
                                   us != nullptr ? &draw : nullptr);
      reached = d + 1;
      path += logp[(size_t)d * k];
      if (d + 1 == depth || path < log_min_path || token < 0 || token >= V) {
        break;
      }
      mtp_row(m, token, cur.data(), T + d, next.data());
      cur.swap(next);
    }
    outs[2].data<int32_t>()[0] = reached;
  };
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::Shape> shapes = {{depth, k}, {depth, k}, {1}};
  std::vector<mx::Dtype> dtypes = {mx::int32, mx::float32, mx::int32};
  if (T > 0) {
    shapes.insert(shapes.end(), {{1, Hkv, T, D}, {1, Hkv, T, D}, {1, 1, H}});
    dtypes.insert(dtypes.end(), {mx::float32, mx::float32, mx::float32});
  }
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<CpuPrimitive>(s, "MtpChain", body), std::move(inputs));
}

// choose_rows: each row's token, chosen as engine/device_sampler.py's choose does in MLX's
// operations, and where asked the target's top-token probability of each row (its
// top_probability), in one operation. In MLX's operations the two are ~13 graph nodes, each a pass
// over the vocabulary with its own scheduling: one row of 8,192 logits, sampled, evaluated alone on
// the dev CPU, 184 us against 125-138 here, ~67 of either the evaluation's own round trip.
// - greedy (temperature 0): the first largest logit, as MLX's argmax;
// - sampled: p = 2^(((x - max) / t) log2 e) (without the division at t = 1), its running sum in
//   vocabulary order (MLX's cumsum on the CPU: a sequential sum), the first token whose running sum
//   passes u * total, the last token with p > 0 where rounding runs past the end. The same
//   arithmetic step for step, powf through whatever `powf` the process resolves (the engine's
//   exp2 shim where it is preloaded, engine/exp2_shim.c), as MLX's power reaches it: the same
//   tokens bit for bit (tests/engine/test_cpu_choose.py), top-k, top-p and min-p cuts included
//   (apply_cuts). With the bundled model's default cuts (top-k 20, top-p 0.8) the operations took
//   ~270 us a row, sorting and scanning in ~15 more nodes.
// - top: 1 / sum(2^((r - max) log2 e)) over the row of `raw` (the logits before bias and
//   penalties), a pass of exp2_lanes in 16 lanes (~2 us for 8,192 logits against ~30 through
//   powf), whatever the draw computed. Within float32 rounding of MLX's value (its sum in another
//   order: ~1e-5 relative over 8,192 terms); it steers only the tree-size controller
//   (engine/spec_gate.py), never a token.
using powf_fn = float (*)(float, float);

powf_fn process_powf() {
  static const powf_fn fn = [] {
    void* sym = dlsym(RTLD_DEFAULT, "powf");
    return sym != nullptr ? reinterpret_cast<powf_fn>(sym) : static_cast<powf_fn>(::powf);
  }();
  return fn;
}

constexpr float LOG2E_F = 1.4426950408889634f;  // MLX multiplies a float32 array by the float32 of log2 e

inline float row_max(const float* x, int V) {
  float m = x[0];
  for (int i = 1; i < V; ++i) {
    m = x[i] > m ? x[i] : m;
  }
  return m;
}

// The running sum's total of 2^(((x - m) / t) log2 e) into p (t = 1: no division), in order.
float shifted_powers(const float* x, int V, float m, float t, float* p) {
  const powf_fn pw = process_powf();
  float total = 0.0f;
  for (int i = 0; i < V; ++i) {
    const float y = t == 1.0f ? (x[i] - m) * LOG2E_F : ((x[i] - m) / t) * LOG2E_F;
    p[i] = pw(2.0f, y);
    total = i == 0 ? p[i] : total + p[i];
  }
  return total;
}

// sum(2^((x - max) log2 e)) of a row in 16 lanes (exp2_lanes' series; a masked -inf token counts
// 2^-125 instead of 0): the top-token probability's total. Not the draw's arithmetic, and need not
// be: it steers the controller only.
float top_total(const float* x, int V) {
  const float m = row_max(x, V);
  v16 acc = {};
  int i = 0;
  for (; i + 16 <= V; i += 16) {
    acc += exp2_lanes((*(const v16u*)(x + i) - m) * LOG2E_F);
  }
  float total = lanes_sum(acc);
  for (; i < V; ++i) {
    total += std::exp2((x[i] - m) * LOG2E_F);
  }
  return total;
}

// A draw's top-k, top-p and min-p cuts (engine/device_sampler.py probabilities): p outside them
// set to 0.
struct Cuts {
  int top_k = 0;       // none where 0 or >= V
  float top_p = 1.0f;  // none where >= 1
  float min_p = 0.0f;  // none where <= 0
};

// In order, as the operations cut: top-k keeps the values at or above the k-th largest (ties past k
// too); top-p ranks what is left best first (the k values taken by top-k, else every value), keeps
// a rank while the running sum before it is short of top_p times the total (the sum of what top-k
// kept in vocabulary order, else the ranked running sum's last; both sequential, as MLX's cumsum
// sums on the CPU) and cuts below the last rank kept; min-p keeps the values at or above min_p
// times the largest left. Every comparison on the same float32 values as the operations'.
//
// The values are ranked by their bits: p >= 0, where a float's bits order as its value does, and an
// integer order is total (a NaN from broken logits ranks first instead of breaking the sort). A
// full ranking (top-p without top-k) is an LSD radix sort, ~25 us for 8,192 values where
// std::sort took ~300.
void rank_descending(std::vector<uint32_t>& keys, int n, std::vector<uint32_t>& tmp) {
  tmp.resize(n);
  uint32_t* a = keys.data();
  uint32_t* b = tmp.data();
  for (int shift = 0; shift < 32; shift += 11) {  // 11, 11 and 10 bits: three passes
    int count[2049] = {};
    for (int i = 0; i < n; ++i) {
      ++count[((a[i] >> shift) & 2047u) + 1];
    }
    for (int d = 0; d < 2048; ++d) {
      count[d + 1] += count[d];
    }
    for (int i = 0; i < n; ++i) {
      b[count[(a[i] >> shift) & 2047u]++] = a[i];
    }
    std::swap(a, b);
  }
  if (a != keys.data()) {  // an odd number of passes left the result in tmp
    std::copy(a, a + n, keys.data());
  }
  std::reverse(keys.begin(), keys.begin() + n);
}

inline uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

void apply_cuts(float* p, int V, const Cuts& c, std::vector<uint32_t>& ranked, std::vector<uint32_t>& tmp) {
  const bool by_k = 0 < c.top_k && c.top_k < V;
  const bool by_p = c.top_p < 1.0f;
  int n = V;
  if (by_k || by_p) {
    ranked.resize(V);
    for (int i = 0; i < V; ++i) {
      ranked[i] = bits_of(p[i]);
    }
  }
  if (by_k) {
    std::nth_element(ranked.begin(), ranked.begin() + (c.top_k - 1), ranked.end(), std::greater<uint32_t>());
    const float kth = float_of(ranked[c.top_k - 1]);
    for (int i = 0; i < V; ++i) {
      p[i] = p[i] >= kth ? p[i] : 0.0f;
    }
    n = c.top_k;
  }
  if (by_p) {
    if (by_k) {
      std::sort(ranked.begin(), ranked.begin() + n, std::greater<uint32_t>());
    } else {
      rank_descending(ranked, n, tmp);
    }
    float total = 0.0f;
    if (by_k) {
      for (int i = 0; i < V; ++i) {
        total = i == 0 ? p[i] : total + p[i];
      }
    } else {
      for (int j = 0; j < n; ++j) {
        total = j == 0 ? float_of(ranked[j]) : total + float_of(ranked[j]);
      }
    }
    const float target = c.top_p * total;
    float cum = 0.0f, cut = INFINITY;
    for (int j = 0; j < n; ++j) {
      const float v = float_of(ranked[j]);
      cum = j == 0 ? v : cum + v;
      if (cum - v < target) {
        cut = std::min(cut, v);
      }
    }
    for (int i = 0; i < V; ++i) {
      p[i] = p[i] >= cut ? p[i] : 0.0f;
    }
  }
  if (c.min_p > 0.0f) {
    const float floor_ = c.min_p * row_max(p, V);
    for (int i = 0; i < V; ++i) {
      p[i] = p[i] >= floor_ ? p[i] : 0.0f;
    }
  }
}

// A top-k draw narrowed to the values that can reach the k-th largest (the bundled model's default
// top-k of 20 among 8,192): the same token as choose_row's full pass, without 2^y of every logit.
// y = ((x - max) / t) log2 e is computed for every logit as shifted_powers does (float operations
// are monotone, so y orders as x does); 2^y only where y >= y_k - NARROW, y_k the k-th largest y.
// Why that is exact: the k entries of largest y all have y >= y_k, so the k-th largest 2^y is at
// least 2^y_k (1 - e) for a powf of relative error e, and an entry below y_k - NARROW has 2^y at
// most 2^(y_k - NARROW) (1 + e), less than that for any e under 2^-16 (libm's powf and the exp2
// shim: under 2^-23). So every value the operations keep, ties at the k-th included, is among
// those computed, and the k-th largest of them is theirs; top-p, min-p, the total and the draw
// then run over the kept values in vocabulary order, which is where the full pass's running sums
// add anything but zeros. Where that reasoning does not hold, the full pass runs: a NaN or +inf
// logit, or a k-th largest value under FLT_MIN (a subnormal 2^y has no such relative error, and a
// zero keeps every token). Returns -1 there.
constexpr float NARROW = 1e-4f;  // > 2^-15 / ln 2 plus y's rounding at |y| < 150 (2^-17)

struct Narrow {
  std::vector<float> y, kept_p;
  std::vector<int> kept;
  std::vector<uint32_t> bits;
};

// The first `live` kept values at or above `floor`, compacted to the front in order -> how many.
int keep_from(Narrow& s, int live, float floor) {
  int kept = 0;
  for (int j = 0; j < live; ++j) {
    if (s.kept_p[j] >= floor) {
      s.kept[kept] = s.kept[j];
      s.kept_p[kept++] = s.kept_p[j];
    }
  }
  return kept;
}

int32_t draw_top_k(const float* x, int V, float t, const Cuts& c, float u, Narrow& s) {
  const float m = row_max(x, V);
  s.y.resize(V);
  bool nan = false;
  for (int i = 0; i < V; ++i) {
    const float y = t == 1.0f ? (x[i] - m) * LOG2E_F : ((x[i] - m) / t) * LOG2E_F;
    s.y[i] = y;
    nan |= y != y;
  }
  if (nan) {
    return -1;
  }
  // the k-th largest y: a min-heap of the k largest seen (in kept_p's storage, refilled below)
  const int k = c.top_k;
  std::vector<float>& heap = s.kept_p;
  heap.assign(s.y.begin(), s.y.begin() + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  for (int i = k; i < V; ++i) {
    if (s.y[i] > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
      heap.back() = s.y[i];
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    }
  }
  const float floor_y = heap.front() - NARROW;
  const powf_fn pw = process_powf();
  s.kept.clear();
  s.kept_p.clear();
  s.bits.clear();
  for (int i = 0; i < V; ++i) {
    if (s.y[i] >= floor_y) {
      const float p = pw(2.0f, s.y[i]);
      s.kept.push_back(i);
      s.kept_p.push_back(p);
      s.bits.push_back(bits_of(p));
    }
  }
  const int n = (int)s.kept.size();
  std::nth_element(s.bits.begin(), s.bits.begin() + (k - 1), s.bits.end(), std::greater<uint32_t>());
  const float kth = float_of(s.bits[k - 1]);
  if (!(kth >= FLT_MIN) || kth == INFINITY) {
    return -1;
  }
  // top-k, then top-p over what it kept (ranked best first), then min-p: compacted in place
  int live = keep_from(s, n, kth);
  if (c.top_p < 1.0f) {
    s.bits.resize(live);
    float total = 0.0f;
    for (int j = 0; j < live; ++j) {
      s.bits[j] = bits_of(s.kept_p[j]);
      total = j == 0 ? s.kept_p[j] : total + s.kept_p[j];
    }
    std::sort(s.bits.begin(), s.bits.end(), std::greater<uint32_t>());
    // the operations rank the k values top-k took (not its ties past k): the first k of these
    const int ranks = std::min(live, k);
    const float target = c.top_p * total;
    float cum = 0.0f, cut = INFINITY;
    for (int j = 0; j < ranks; ++j) {
      const float v = float_of(s.bits[j]);
      cum = j == 0 ? v : cum + v;
      if (cum - v < target) {
        cut = std::min(cut, v);
      }
    }
    live = keep_from(s, live, cut);
  }
  if (c.min_p > 0.0f && live > 0) {
    float top = s.kept_p[0];
    for (int j = 1; j < live; ++j) {
      top = s.kept_p[j] > top ? s.kept_p[j] : top;
    }
    live = keep_from(s, live, c.min_p * top);
  }
  if (live == 0) {
    return -1;
  }
  float total = 0.0f;
  for (int j = 0; j < live; ++j) {
    total = j == 0 ? s.kept_p[j] : total + s.kept_p[j];
  }
  const float threshold = u * total;
  float run = 0.0f;
  for (int j = 0; j < live; ++j) {
    run = j == 0 ? s.kept_p[j] : run + s.kept_p[j];
    if (run > threshold) {
      return s.kept[j];
    }
  }
  return s.kept[live - 1];  // rounding ran past the end: the last live token
}

int32_t choose_row(const float* x, int V, float t, const Cuts& cuts, float u, std::vector<float>& p,
                   std::vector<uint32_t>& ranked, std::vector<uint32_t>& tmp, Narrow* narrow) {
  if (t <= 0.0f) {
    int best = 0;
    for (int i = 1; i < V; ++i) {
      best = x[i] > x[best] ? i : best;
    }
    return best;
  }
  if (narrow != nullptr && 0 < cuts.top_k && cuts.top_k < V) {
    const int32_t id = draw_top_k(x, V, t, cuts, u, *narrow);
    if (id >= 0) {
      return id;
    }
  }
  float total = shifted_powers(x, V, row_max(x, V), t, p.data());
  if ((0 < cuts.top_k && cuts.top_k < V) || cuts.top_p < 1.0f || cuts.min_p > 0.0f) {
    apply_cuts(p.data(), V, cuts, ranked, tmp);
    for (int i = 0; i < V; ++i) {
      total = i == 0 ? p[i] : total + p[i];
    }
  }
  const float threshold = u * total;
  float run = 0.0f;
  for (int i = 0; i < V; ++i) {
    run = i == 0 ? p[i] : run + p[i];
    if (run > threshold) {
      return i;
    }
  }
  for (int i = V - 1; i > 0; --i) {  // rounding ran past the end: the last live token
    if (p[i] > 0.0f) {
      return i;
    }
  }
  return p[0] > 0.0f ? 0 : V - 1;
}

std::vector<mx::array> choose_rows(const mx::array& logits, const std::optional<mx::array>& uniforms, float temperature,
                                   const std::optional<mx::array>& raw, int top_k, float top_p, float min_p,
                                   bool narrow) {
  check_f32("choose_rows", {&logits});
  if (logits.ndim() != 2 || logits.shape(1) < 1) {
    throw std::invalid_argument("choose_rows: logits must be [N, V]");
  }
  const int N = logits.shape(0), V = logits.shape(1);
  const bool sampled = temperature > 0.0f;
  if (sampled && (!uniforms || uniforms->dtype() != mx::float32 || uniforms->size() != (size_t)N)) {
    throw std::invalid_argument("choose_rows: a sampled choice needs float32 uniforms [N]");
  }
  if (raw && (raw->dtype() != mx::float32 || raw->shape() != logits.shape())) {
    throw std::invalid_argument("choose_rows: raw must be float32 and shaped as logits");
  }
  std::vector<mx::array> inputs = {logits};
  if (sampled) {
    inputs.push_back(*uniforms);
  }
  const bool top = raw.has_value();
  if (top) {
    inputs.push_back(*raw);
  }
  const Cuts cuts{top_k, top_p, min_p};
  auto body = [N, V, temperature, sampled, top, cuts, narrow](std::vector<mx::array>& ins,
                                                               std::vector<mx::array>& outs) {
    const DenseInputs in(ins);
    const float* x = in(0);
    const float* u = sampled ? in(1) : nullptr;
    const float* r = top ? in(sampled ? 2 : 1) : nullptr;
    int32_t* ids = outs[0].data<int32_t>();
    std::vector<float> p(sampled ? V : 0);
    std::vector<uint32_t> ranked, tmp;
    Narrow scratch;
    for (int n = 0; n < N; ++n) {
      ids[n] = choose_row(x + (int64_t)n * V, V, temperature, cuts, sampled ? u[n] : 0.0f, p, ranked, tmp,
                          narrow ? &scratch : nullptr);
      if (top) {
        outs[1].data<float>()[n] = 1.0f / top_total(r + (int64_t)n * V, V);
      }
    }
  };
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::Shape> shapes = {{N}};
  std::vector<mx::Dtype> dtypes = {mx::int32};
  if (top) {
    shapes.push_back({N});
    dtypes.push_back(mx::float32);
  }
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<CpuPrimitive>(s, "ChooseRows", body), std::move(inputs));
}

// A request's penalties on one logit v (engine/device_penalties.py _adjust, element by element):
// v + bias, less frequency * count + (presence where count > 0), then the repetition penalty where
// the token is in the prompt (seen != 0) or counted. Each step rounded apart (-ffp-contract=off).
struct Penalties {
  float frequency, presence, repetition;
  bool penalized, repeats;

  float apply(float v, float b, bool biased, float c, float seen) const {
    if (biased) {
      v = v + b;
    }
    if (penalized) {
      const float t = frequency * c;
      v = v - (t + (c > 0.0f ? presence : 0.0f));
    }
    if (repeats && (seen != 0.0f || c > 0.0f)) {
      v = v > 0.0f ? v / repetition : v * repetition;
    }
    return v;
  }
};

// penalize_rows: a request's logit bias and penalties over every row of a round's logits
// (engine/device_penalties.py DevicePenalties._adjust, its elementwise pass in one operation):
// x + bias, less frequency * count + (presence where count > 0), then the repetition penalty (x / r
// where x > 0, else x * r) on the tokens of the prompt or counted. In MLX's operations that is ~8
// nodes over the vocabulary a round, ~100 us of a ~1.5 ms decode step on the dev CPU with the
// bundled model's default repetition penalty. The same float32 operations in the same order, each
// rounded apart (-ffp-contract=off): bit for bit (tests/engine/test_cpu_choose.py).
mx::array penalize_rows(const mx::array& x, const mx::array& counts, const std::optional<mx::array>& bias,
                        const std::optional<mx::array>& in_prompt, float frequency, float presence, float repetition,
                        bool penalized) {
  check_f32("penalize_rows", {&x, &counts});
  if (x.ndim() != 2 || counts.ndim() != 1 || counts.shape(0) != x.shape(1)) {
    throw std::invalid_argument("penalize_rows: x must be [N, V] and counts [V]");
  }
  for (const auto* a : {&bias, &in_prompt}) {
    if (a->has_value() && ((*a)->dtype() != mx::float32 || (*a)->shape() != counts.shape())) {
      throw std::invalid_argument("penalize_rows: bias and in_prompt must be float32 [V]");
    }
  }
  const int N = x.shape(0), V = x.shape(1);
  const bool biased = bias.has_value(), repeats = in_prompt.has_value();
  std::vector<mx::array> inputs = {x, counts};
  if (biased) {
    inputs.push_back(*bias);
  }
  if (repeats) {
    inputs.push_back(*in_prompt);
  }
  const Penalties pen{frequency, presence, repetition, penalized, repeats};
  auto body = [N, V, biased, repeats, pen](std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
    const DenseInputs in(ins);
    const float *x = in(0), *c = in(1);
    const float* b = biased ? in(2) : nullptr;
    const float* seen = repeats ? in(biased ? 3 : 2) : nullptr;
    float* y = outs[0].data<float>();
    for (int n = 0; n < N; ++n) {
      for (int i = 0; i < V; ++i) {
        y[(int64_t)n * V + i] = pen.apply(x[(int64_t)n * V + i], b != nullptr ? b[i] : 0.0f, b != nullptr, c[i],
                                          seen != nullptr ? seen[i] : 0.0f);
      }
    }
  };
  return cpu_op("PenalizeRows", x.shape(), body, std::move(inputs));
}

// top_rows_now: the top-token probability of some rows of an evaluated [N, V] array, at once on the
// calling thread (1 / top_total): the controller's confidence in a tree's accepted rows
// (engine/round.py _top). NumPy's float64 pass over three rows of 8,192 took ~0.12 ms a round on
// the dev CPU; this is a few us, within ~2e-5 of it, and it steers the controller only.
std::vector<float> top_rows_now(const mx::array& logits, const std::vector<int>& rows) {
  check_f32("top_rows_now", {&logits});
  if (logits.ndim() != 2) {
    throw std::invalid_argument("top_rows_now: logits [N, V]");
  }
  const int N = logits.shape(0), V = logits.shape(1);
  nb::gil_scoped_release free_threads;  // the wait for the verify lets the server's other threads run
  mx::eval({logits});
  std::vector<float> tmp;
  const float* x = dense(logits, tmp);
  std::vector<float> out;
  out.reserve(rows.size());
  for (const int r : rows) {
    if (r < 0 || r >= N) {
      throw std::invalid_argument("top_rows_now: a row outside the array");
    }
    out.push_back(1.0f / top_total(x + (int64_t)r * V, V));
  }
  return out;
}

// draw_now: the token of one node of a landed verify, chosen on the calling thread at once: the
// node's row of the evaluated logits, the request's bias and penalties (the completion's counts,
// and the node's own path tokens counted again, as engine/device_penalties.py apply recomputes
// them), then choose_row. Bit for bit what penalize_rows and choose_rows give the row in a graph,
// without one: a sampled tree's nodes are drawn one by one as the accept walk visits them
// (engine/round.py), and each such draw as a graph of its own waited ~0.15 ms on MLX's evaluation
// for ~30 us of arithmetic (dev CPU, bundled target, ~3 draws a round). Returns the token id.
int32_t draw_now(const mx::array& logits, int row, const std::optional<mx::array>& counts,
                 const std::optional<mx::array>& bias, const std::optional<mx::array>& in_prompt,
                 const std::vector<int>& cols, const std::vector<float>& extra, float frequency, float presence,
                 float repetition, bool penalized, float temperature, int top_k, float top_p, float min_p, float u,
                 bool narrow) {
  check_f32("draw_now", {&logits});
  if (logits.ndim() != 2 || row < 0 || row >= logits.shape(0) || !(temperature > 0.0f)) {
    throw std::invalid_argument("draw_now: logits [N, V], a row of them, a sampled draw");
  }
  const int V = logits.shape(1);
  std::vector<mx::array> wait = {logits};
  for (const auto* a : {&counts, &bias, &in_prompt}) {
    if (a->has_value()) {
      if ((*a)->dtype() != mx::float32 || (*a)->ndim() != 1 || (*a)->shape(0) != V) {
        throw std::invalid_argument("draw_now: counts, bias and in_prompt must be float32 [V]");
      }
      wait.push_back(**a);
    }
  }
  if (cols.size() != extra.size()) {
    throw std::invalid_argument("draw_now: one extra count a column");
  }
  nb::gil_scoped_release free_threads;  // the wait for the verify lets the server's other threads run
  mx::eval(wait);
  std::vector<float> tmp, ctmp, btmp, stmp;
  const float* x = dense(logits, tmp) + (int64_t)row * V;
  std::vector<float> y;  // the adjusted row, where there are penalties: else the row is read in place
  if (counts.has_value()) {
    y.resize(V);
    const Penalties pen{frequency, presence, repetition, penalized, in_prompt.has_value()};
    const float* c = dense(*counts, ctmp);
    const float* b = bias.has_value() ? dense(*bias, btmp) : nullptr;
    const float* seen = in_prompt.has_value() ? dense(*in_prompt, stmp) : nullptr;
    for (int i = 0; i < V; ++i) {
      y[i] = pen.apply(x[i], b != nullptr ? b[i] : 0.0f, b != nullptr, c[i], seen != nullptr ? seen[i] : 0.0f);
    }
    for (size_t j = 0; j < cols.size(); ++j) {  // the node's path tokens, counted again from the raw logit
      const int i = cols[j];
      if (i < 0 || i >= V) {
        throw std::invalid_argument("draw_now: a path token outside the vocabulary");
      }
      y[i] = pen.apply(x[i], b != nullptr ? b[i] : 0.0f, b != nullptr, c[i] + extra[j],
                       seen != nullptr ? seen[i] : 0.0f);
    }
  }
  std::vector<float> p(V);
  std::vector<uint32_t> ranked, rtmp;
  Narrow scratch;
  return choose_row(y.empty() ? x : y.data(), V, temperature, Cuts{top_k, top_p, min_p}, u, p, ranked, rtmp,
                    narrow ? &scratch : nullptr);
}

}  // namespace

NB_MODULE(spruce_cpu_ext, m) {
  m.def("rows_attention_supports", [](int heads_per_kv, int head_dim) { return chunk_kernel(heads_per_kv, head_dim) != nullptr; },
        "Whether rows_attention is built for this many query heads a K/V head and this head dimension.");
  m.def("rows_attention", &rows_attention, nb::arg("q"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"),
        nb::arg("prefix"), nb::arg("seen") = nb::none(), nb::arg("heads_together") = true,
        "Attention of a few query rows over a K/V cache in one CPU operation (engine/cpu_ext.cpp).");
  m.def("causal_attention_supports", [](int head_dim) { return causal_kernel(head_dim) != nullptr; },
        "Whether causal_attention is built for this head dimension.");
  m.def("causal_attention", &causal_attention, nb::arg("q"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"),
        "A prefill chunk's attention: its T rows the last T of the L keys, each seeing those up to itself.");
  m.def("gdn_step", &gdn_step, nb::arg("qkv"), nb::arg("a"), nb::arg("b"), nb::arg("conv_state"), nb::arg("S"),
        nb::arg("conv_w"), nb::arg("A_log"), nb::arg("dt_bias"), nb::arg("Hk"), nb::arg("Dk"),
        "One token of a Gated DeltaNet layer's recurrent core in one CPU operation -> [o, conv_state, S].");
  m.def("draft_attention", &draft_attention, "A drafted row's attention over the committed rows and its scratch.");
  m.def("softmax_rows", &softmax_rows, nb::arg("x"), nb::arg("mask").none() = nb::none(),
        "Softmax over the last axis of float32 rows in one CPU operation; a mask [N, L] drops entries.");
  m.def("rms_norm", &rms_norm, "RMS norm over the last axis, times a weight, in one CPU operation.");
  m.def("gdn_chain", &gdn_chain, "A prefill's chain through a Gated DeltaNet layer's core -> [o, conv state, S].");
  m.def("gdn_tree", &gdn_tree, "A tree's verify through a Gated DeltaNet layer's core -> [o, k, u, g].");
  m.def("gdn_commit", &gdn_commit, "The state after an accepted path of a verified tree.");
  m.def("norm_products", &norm_products, nb::arg("x"), nb::arg("norm_w").none(), nb::arg("eps"), nb::arg("weights"),
        "Rows RMS-normed (or not) and multiplied by several weights in one CPU operation.");
  m.def("mlp_block", &mlp_block, nb::arg("x"), nb::arg("out"), nb::arg("norm_w"), nb::arg("gate_w"), nb::arg("up_w"),
        nb::arg("down_w"), nb::arg("eps"), "A decoder layer's residual add, norm, SwiGLU MLP and add in one CPU operation.");
  m.def("rope", &rope, nb::arg("x"), nb::arg("dims"), nb::arg("base"), nb::arg("offset"),
        nb::arg("positions").none(), "RoPE of [B, H, T, D] rows in one CPU operation (MLX's non-traditional form).");
  m.def("mtp_chain", &mtp_chain, nb::arg("y"), nb::arg("embed"), nb::arg("lm"), nb::arg("vocab_ids").none(),
        nb::arg("w"), nb::arg("keys"), nb::arg("values"), nb::arg("length"), nb::arg("rows_ids").none(),
        nb::arg("rows_hidden").none(), nb::arg("heads"), nb::arg("head_dim"),
        nb::arg("rope_dims"), nb::arg("rope_base"), nb::arg("eps"), nb::arg("scale"), nb::arg("k"), nb::arg("depth"),
        nb::arg("log_min_path"), nb::arg("uniforms").none() = nb::none(), nb::arg("draw_temperature") = 1.0f,
        nb::arg("draw_top_k") = 0, nb::arg("draw_top_p") = 1.0f,
        "An MTP head's chain draft, every depth in one CPU operation (after its catch-up where rows are given) "
        "-> [ids, logp, depths] (+ [keys, values, y] of the catch-up); with uniforms, each chain token drawn "
        "at its depth's uniform under the draw_* settings instead of the argmax.");
  m.def("choose_rows", &choose_rows, nb::arg("logits"), nb::arg("uniforms").none(), nb::arg("temperature"),
        nb::arg("raw").none(), nb::arg("top_k") = 0, nb::arg("top_p") = 1.0f, nb::arg("min_p") = 0.0f,
        nb::arg("narrow") = true,
        "Each row's token (greedy or the seeded draw) and, where raw is given, its top-token "
        "probability, in one CPU operation -> [ids] (+ [top]); narrow: a top-k draw computes 2^y only "
        "where it can reach the k-th largest value.");
  m.def("top_rows_now", &top_rows_now, nb::arg("logits"), nb::arg("rows"),
        "The top-token probability of rows of an evaluated [N, V] float32 array, at once on the host.");
  m.def("draw_now", &draw_now, nb::arg("logits"), nb::arg("row"), nb::arg("counts").none(), nb::arg("bias").none(),
        nb::arg("in_prompt").none(), nb::arg("cols"), nb::arg("extra"), nb::arg("frequency"), nb::arg("presence"),
        nb::arg("repetition"), nb::arg("penalized"), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"),
        nb::arg("min_p"), nb::arg("u"), nb::arg("narrow") = true,
        "One node's sampled token of an evaluated verify, its penalties applied, chosen at once on the host.");
  m.def("penalize_rows", &penalize_rows, nb::arg("x"), nb::arg("counts"), nb::arg("bias").none(),
        nb::arg("in_prompt").none(), nb::arg("frequency"), nb::arg("presence"), nb::arg("repetition"),
        nb::arg("penalized"), "A request's logit bias and penalties over [N, V] rows in one CPU operation.");
}
