// MLX operations of the engine's own for the CPU backend (engine/cpu_ext.py builds and loads this).
//
// MLX's Python API can register kernels for Metal and CUDA (mx.fast.metal_kernel, cuda_kernel) but
// not for the CPU: there a computation is a graph of MLX's own operations, each a scalar loop with
// a scheduling cost of a few microseconds. A C++ primitive compiled against the wheel's headers
// joins the graph like any other operation; its Python binding shares MLX's nanobind domain
// ("mlx"), so it takes and returns mx.array.
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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr int CHUNK = 512;  // keys a work item takes (of one KV head, one row)
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

struct AttentionJob {
  const float* q;  // [H, N, D], contiguous
  const float* k;  // [Hkv, L, D] with strides (k_head, k_row, 1)
  const float* v;
  const bool* seen;  // [N, T] or null (every key seen)
  float* out;        // [H, N, D]
  int64_t k_head, k_row, v_head, v_row;
  int H, Hkv, N, D, L, prefix, T;
  float scale;
  int chunks;  // chunks a row of the longest key list has
  // per row: its tree keys' indices (into the cache), in order, and how many keys it sees
  std::vector<std::vector<int>> tree_keys;
  std::vector<int> counts;
  // per item (KV head, row, chunk): G maxima, G sums, G x D weighted values
  std::vector<float> partial;
  void (*kernel)(const AttentionJob&, int, int, int, float*) = nullptr;  // chunk_kernel(G, D)
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
  v8 lo, hi;
  std::memcpy(&lo, &x, sizeof lo);
  std::memcpy(&hi, (const char*)&x + sizeof lo, sizeof hi);
  const v8 a8 = lo + hi;
  v4 l4, h4;
  std::memcpy(&l4, &a8, sizeof l4);
  std::memcpy(&h4, (const char*)&a8 + sizeof l4, sizeof h4);
  const v4 a4 = l4 + h4;
  return (a4[0] + a4[2]) + (a4[1] + a4[3]);
}

// 2^x for x <= 0, 16 at a time: x = n + f with n an integer and f in [-0.5, 0.5], 2^f by its
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

// The key at logical position j of row n: the prefix in order, then the row's tree keys.
inline int key_index(const AttentionJob& job, int n, int j) {
  return j < job.prefix ? j : job.tree_keys[n][j - job.prefix];
}

// One work item: KV head h, row n, chunk c -> the G query heads' (of this KV head) maxima, sums
// and unnormalised outputs, for G query heads of DV x 16 dimensions held in registers. Items past
// a row's keys write nothing and are skipped when joining.
template <int G, int DV>
void attention_chunk(const AttentionJob& job, int h, int n, int c, float* part) {
  const int j0 = c * CHUNK, j1 = std::min(job.counts[n], j0 + CHUNK), count = j1 - j0;
  if (count <= 0) {
    return;
  }
  constexpr int D = DV * 16;
  v16 qs[G][DV];  // the query rows, scaled as the operations' path scales them
  for (int g = 0; g < G; ++g) {
    const float* q = job.q + ((int64_t)(h * G + g) * job.N + n) * D;
    for (int dv = 0; dv < DV; ++dv) {
      qs[g][dv] = *(const v16u*)(q + dv * 16) * job.scale;
    }
  }
  alignas(64) float scores[G][CHUNK + 16];
  float m[G];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
  }
  const float* kbase = job.k + h * job.k_head;
  const float* vbase = job.v + h * job.v_head;
  for (int j = j0; j < j1; ++j) {
    const float* k = kbase + (int64_t)key_index(job, n, j) * job.k_row;
    v16 kr[DV];
    for (int dv = 0; dv < DV; ++dv) {
      kr[dv] = *(const v16u*)(k + dv * 16);
    }
    for (int g = 0; g < G; ++g) {
      v16 a = qs[g][0] * kr[0];
      for (int dv = 1; dv < DV; ++dv) {
        a += qs[g][dv] * kr[dv];
      }
      const float s = lanes_sum(a);
      scores[g][j - j0] = s;
      m[g] = std::max(m[g], s);
    }
  }
  float* ms = part;
  float* ls = part + G;
  float* out = part + 2 * G;
  const int padded = (count + 15) / 16 * 16;
  for (int g = 0; g < G; ++g) {
    v16 sum = {};
    for (int j = 0; j < padded; j += 16) {
      v16 e = exp2_lanes((*(v16*)&scores[g][j] - m[g]) * LOG2E);
      if (j + 16 > count) {  // the lanes past the chunk's keys weigh nothing
        for (int i = count - j; i < 16; ++i) {
          e[i] = 0.0f;
        }
      }
      *(v16*)&scores[g][j] = e;
      sum += e;
    }
    ms[g] = m[g];
    ls[g] = lanes_sum(sum);
  }
  v16 acc[G][DV] = {};
  for (int j = j0; j < j1; ++j) {
    const float* v = vbase + (int64_t)key_index(job, n, j) * job.v_row;
    v16 vr[DV];
    for (int dv = 0; dv < DV; ++dv) {
      vr[dv] = *(const v16u*)(v + dv * 16);
    }
    for (int g = 0; g < G; ++g) {
      const float p = scores[g][j - j0];
      for (int dv = 0; dv < DV; ++dv) {
        acc[g][dv] += p * vr[dv];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int dv = 0; dv < DV; ++dv) {
      std::memcpy(out + g * D + dv * 16, &acc[g][dv], sizeof(v16));
    }
  }
}

using chunk_fn = void (*)(const AttentionJob&, int, int, int, float*);

template <int DV>
chunk_fn chunk_for_heads(int G) {
  switch (G) {
    case 1: return attention_chunk<1, DV>;
    case 2: return attention_chunk<2, DV>;
    case 3: return attention_chunk<3, DV>;
    case 4: return attention_chunk<4, DV>;
    case 5: return attention_chunk<5, DV>;
    case 6: return attention_chunk<6, DV>;
    case 7: return attention_chunk<7, DV>;
    case 8: return attention_chunk<8, DV>;
    default: return nullptr;
  }
}

// The item kernel for G query heads a KV head and head dimension D; null where none is built (the
// caller keeps MLX's operations then: engine/cpu_ext.py asks `rows_attention_supports`).
chunk_fn chunk_kernel(int G, int D) {
  switch (D) {
    case 16: return chunk_for_heads<1>(G);
    case 32: return chunk_for_heads<2>(G);
    case 64: return chunk_for_heads<4>(G);
    case 128: return chunk_for_heads<8>(G);
    case 256: return chunk_for_heads<16>(G);
    default: return nullptr;
  }
}

void attention_items(void* ctx, int i0, int i1) {
  auto& job = *static_cast<AttentionJob*>(ctx);
  for (int i = i0; i < i1; ++i) {
    const int c = i % job.chunks, hn = i / job.chunks;
    const int n = hn % job.N, h = hn / job.N;
    job.kernel(job, h, n, c, job.partial.data() + (int64_t)i * job.stride());
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

class RowsAttention : public mx::Primitive {
 public:
  RowsAttention(mx::Stream s, float scale, int prefix) : mx::Primitive(s), scale_(scale), prefix_(prefix) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2];
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
    }
    encoder.set_output_array(out);
    const bool masked = inputs.size() == 4;
    encoder.dispatch([q = mx::array::unsafe_weak_copy(q), k = mx::array::unsafe_weak_copy(k),
                      v = mx::array::unsafe_weak_copy(v),
                      seen = masked ? mx::array::unsafe_weak_copy(inputs[3]) : mx::array(0),
                      out = mx::array::unsafe_weak_copy(out), masked, scale = scale_, prefix = prefix_]() mutable {
      AttentionJob job;
      job.H = q.shape(1), job.N = q.shape(2), job.D = q.shape(3);
      job.Hkv = k.shape(1), job.L = k.shape(2);
      job.prefix = prefix, job.T = job.L - prefix, job.scale = scale;
      job.q = q.data<float>(), job.k = k.data<float>(), job.v = v.data<float>();
      job.k_head = k.strides(1), job.k_row = k.strides(2), job.v_head = v.strides(1), job.v_row = v.strides(2);
      job.seen = masked ? seen.data<bool>() : nullptr;
      job.out = out.data<float>();
      job.kernel = chunk_kernel(job.H / job.Hkv, job.D);
      job.tree_keys.resize(job.N);
      job.counts.resize(job.N);
      int longest = 0;
      for (int n = 0; n < job.N; ++n) {
        for (int t = 0; t < job.T; ++t) {
          if (job.seen == nullptr || job.seen[(int64_t)n * job.T + t]) {
            job.tree_keys[n].push_back(prefix + t);
          }
        }
        job.counts[n] = prefix + (int)job.tree_keys[n].size();
        longest = std::max(longest, job.counts[n]);
      }
      job.chunks = std::max(1, (longest + CHUNK - 1) / CHUNK);
      const int items = job.Hkv * job.N * job.chunks;
      job.partial.resize((int64_t)items * job.stride());
      run_parallel(attention_items, &job, items);
      join_chunks(job);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("rows_attention runs on the CPU only");
  }

  const char* name() const override { return "RowsAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RowsAttention&>(other);
    return scale_ == o.scale_ && prefix_ == o.prefix_;
  }

 private:
  float scale_;
  int prefix_;
};

// q [1, H, N, D], keys / values [1, Hkv, L, D] (float32; the rows of a head may be a view into a
// longer cache), seen [N, L - prefix] bool or none -> [1, H, N, D] float32.
mx::array rows_attention(const mx::array& q, const mx::array& keys, const mx::array& values, float scale,
                         int prefix, const std::optional<mx::array>& seen) {
  if (q.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4 || q.shape(0) != 1 || keys.shape(0) != 1) {
    throw std::invalid_argument("rows_attention: q [1, H, N, D], keys and values [1, Hkv, L, D]");
  }
  const int H = q.shape(1), N = q.shape(2), D = q.shape(3), Hkv = keys.shape(1), L = keys.shape(2);
  if (q.dtype() != mx::float32 || keys.dtype() != mx::float32 || values.dtype() != mx::float32) {
    throw std::invalid_argument("rows_attention: float32 only");
  }
  if (keys.shape() != values.shape() || keys.shape(3) != D || Hkv < 1 || H % Hkv != 0 ||
      chunk_kernel(H / Hkv, D) == nullptr || prefix < 0 || prefix > L || (!seen && prefix != L)) {
    throw std::invalid_argument("rows_attention: shapes do not match");
  }
  if (seen && (seen->ndim() != 2 || seen->shape(0) != N || seen->shape(1) != L - prefix || seen->dtype() != mx::bool_)) {
    throw std::invalid_argument("rows_attention: seen must be bool [N, L - prefix]");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  // q whole; the cache views need only rows of D contiguous floats (MLX's slices of the buffer)
  std::vector<mx::array> inputs = {mx::contiguous(q, false, s)};
  for (const auto* a : {&keys, &values}) {
    inputs.push_back(a->strides(3) == 1 ? *a : mx::contiguous(*a, false, s));
  }
  if (seen) {
    inputs.push_back(mx::contiguous(*seen, false, s));
  }
  return mx::array({1, H, N, D}, mx::float32, std::make_shared<RowsAttention>(s, scale, prefix), inputs);
}

}  // namespace

NB_MODULE(spruce_cpu_ext, m) {
  m.def("rows_attention_supports", [](int heads_per_kv, int head_dim) { return chunk_kernel(heads_per_kv, head_dim) != nullptr; },
        "Whether rows_attention is built for this many query heads a K/V head and this head dimension.");
  m.def("rows_attention", &rows_attention, nb::arg("q"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"),
        nb::arg("prefix"), nb::arg("seen") = nb::none(),
        "Attention of a few query rows over a K/V cache in one CPU operation (engine/cpu_ext.cpp).");
}
