/* cblas_sgemm for MLX's Linux CPU backend: products of 1 to 33 rows computed here, on every core,
 * without packing; products of one column go to cblas_sgemv; the rest to OpenBLAS.
 *
 * Why: MLX's CPU matmul calls cblas_sgemm for every float32 product (mlx 0.32,
 * mlx/backend/cpu/gemms/cblas.cpp). A decode step multiplies one row by every weight, a verify
 * 2-33 rows, and OpenBLAS 0.3.21 (Debian 12's) runs both through its full GEMM, which first copies
 * the whole weight into packed panels and then reads it again: in a 9-row verify of the bundled
 * model on the dev CPU the packing took more time than the arithmetic (perf: sgemm_incopy 25 % of
 * the samples, sgemm_kernel 17 %). Here a product of up to SMALL_ROWS rows by a weight stored
 * [N, K] (x @ W.T, MLX's form of a linear layer) streams each weight row once and multiplies it
 * into every row from cache; products with B stored [K, N] (a verify's attention and GDN heads)
 * take an outer-product kernel. Both split the output columns over the process's cores.
 *
 * Batch invariance: every output element of x @ W.T is one dot product, summed in the same order
 * (16 lanes along K, then a fixed tree over the lanes) whatever the row count, the tile it falls
 * in or the thread that computes it. So a row's result is bitwise the same in a decode step of one
 * row and in a verify of 2 or of 33; the tests hold that (tests/engine/test_lossless.py, a verify
 * row against the plain step, through the engine).
 *
 * Half-width weights: a checkpoint stored in bfloat16 runs in float32 on the CPU, so every weight
 * value is a bfloat16 whose low 16 bits are zero: half of the bytes a step reads (the bundled
 * target's 60 MB of float32 weights a step) are those zeros. engine/half_weights.py hands such a
 * weight to spruce_half_add, which checks every value, keeps a bfloat16 copy laid out in panels
 * and answers products of 1 to SMALL_ROWS rows by it from the copy with the panel kernel (below):
 * half the bytes, the same floats after widening, each output summed in k's order whatever the row
 * count. One-row products by a registered weight take this path too, so a decode step's rows equal
 * a verify's bitwise. (The float32 kernel sums in another order: a registered weight's products
 * differ from an unregistered one's by rounding.)
 *
 * engine/blas.py builds this file once per user with the C compiler on PATH and preloads it ahead
 * of OpenBLAS. On x86-64 the vector code is compiled for AVX-512, AVX2 and the baseline, picked at
 * load time. SPRUCE_SMALL_ROWS=0 turns the small-row path off; SPRUCE_GEMM_THREADS caps its threads.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { ROW_MAJOR = 101 };
enum { NO_TRANS = 111, TRANS = 112 };

/* Products of up to this many rows take the small-row path (SPRUCE_SMALL_ROWS sets another limit,
 * 0 turns the path off). Measured on the dev CPU (two hyperthreads of an EPYC with AVX-512), µs a
 * product, OpenBLAS (a GEMV a row up to 4 rows, its GEMM beyond) against this file, with weights
 * streamed from memory as a decode step reads them (`python scripts/bench_gemv_shim.py`): a
 * 768 x 384 weight at 2 / 4 / 8 / 17 / 33 / 48 rows 85 / 98 / 133 / 167 / 224 / 272 against
 * 64 / 75 / 82 / 121 / 190 / 246; the 8192 x 384 output projection 1024 / 1393 / 1503 / 1773 /
 * 2309 / 2690 against 580 / 686 / 749 / 1105 / 1788 / 2375. From a few dozen rows both are bound
 * by the multiply-adds, and past ~64 OpenBLAS's packed GEMM is faster; 33 is a tree of 32 drafted
 * nodes and its root. */
#define SMALL_ROWS 33
/* The small-row path takes one-row products too, so that a decode step's row is bitwise a verify
 * row's. They went to OpenBLAS's GEMV before, which sums in its own order: a verify row's logits
 * were then ~1e-5 from the plain step's (the bundled target's GDN gate projections, too small to
 * get half-width copies; every weight of a float32 checkpoint whose values are not bfloat16), and
 * after 2,048 tokens of random context a seeded draw of the bundled target flipped at the 10th
 * token with speculation on (BENCHMARKS.md, issue 17, fifty-fifth session). The GEMV was a little
 * faster for such weights: the "mid" checkpoint of scripts/bench_decode.py (150 M parameters,
 * hidden 1024, float32 values) decoded at 33.1-33.6 tok/s with one-row products here against
 * 36.3-37.5 through the GEMV (a decode step's host thread builds the next step's graph meanwhile,
 * and on two cores that starved this file's helper more than OpenBLAS's). For small weights the
 * GEMV's call cost more than the arithmetic: the tests' tiny model decodes ~4,800 tok/s with them
 * here against ~2,500 through it. */
/* Products of up to this many rows that the kernels here do not take (A and B both transposed;
 * every product with the small-row path off) run as one cblas_sgemv a row: OpenBLAS's GEMM packs
 * for them too. */
#define GEMV_ROWS 4
/* Below this many multiply-adds a product runs on the calling thread alone: waking a helper costs
 * a few microseconds. */
#define THREADED_MACS (1L << 17)

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                         float*, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

/* How many products this file computed itself or sent to cblas_sgemv (read by the tests through
 * ctypes). */
long spruce_gemv_calls;
/* Settings, read at every call and written through ctypes by engine/blas.py (benchmarks compare
 * within one process): the small-row path's row limit (0: off, every product as before it
 * existed) and the threads it may use, the caller's included (0: every core). */
int spruce_small_rows = SMALL_ROWS;
int spruce_gemm_threads = 0;
/* Products by registered weights read their half-width copies (1) or the float32 weights (0); and
 * how many products read a copy. */
int spruce_half = 1;
long spruce_half_calls;

/* ---- the dot-product kernel ---------------------------------------------------------------- */

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* an unaligned load */
#define INL static inline __attribute__((always_inline))
/* Loops over a tile's rows and columns unrolled, so its accumulators live in registers (at -O2,
 * GCC 12 kept them on the stack: 2-3x slower). */
#define UNROLL _Pragma("GCC unroll 4")
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else /* GCC before 12: the same selection through a mask vector */
typedef int v16i __attribute__((vector_size(64)));
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif
#define LOAD(p) ((v16)(*(const v16u*)(p)))
typedef unsigned int v16w __attribute__((vector_size(64)));
/* Four weight rows of the tile after next, one cache line of each per 16 floats: each tile reads
 * only K floats of a row, too short a stream for the hardware prefetcher to start on (at 2-8 rows
 * prefetching the next tile made a 768 x 384 product 1.3-1.7x faster on the dev CPU, and the one
 * after it a 8192 x 1024 product another ~6 %). */
#define PREFETCH(q, ld)                  \
  do {                                   \
    __builtin_prefetch((q));             \
    __builtin_prefetch((q) + (ld));      \
    __builtin_prefetch((q) + 2L * (ld)); \
    __builtin_prefetch((q) + 3L * (ld)); \
  } while (0)

/* The lane sums as a tree: halves (i, i+8), then (i, i+4), (i, i+2), (i, i+1). Each foldN takes
 * two vectors and leaves both's partial sums side by side, so hsum_group reduces 16 accumulators in
 * 15 vector adds; hsum is the same tree on one vector, so a sum never depends on its neighbours. */
INL v16 fold8(v16 a, v16 b) {
  return SHUF(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         SHUF(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
INL v16 fold4(v16 a, v16 b) {
  return SHUF(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         SHUF(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
INL v16 fold2(v16 a, v16 b) {
  return SHUF(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         SHUF(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
INL v16 fold1(v16 a, v16 b) {
  return SHUF(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         SHUF(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
INL float hsum(v16 v) {
  v16 t = fold8(v, v);
  t = fold4(t, t);
  t = fold2(t, t);
  return fold1(t, t)[0];
}
/* out[j] = hsum(v[j]) for a group of 16 or 8 vectors (a constant once inlined): after the folds,
 * lane L holds the sum of v[reverse4(L)]; a group of 8 folds its last level onto itself, so its
 * sums sit in the even lanes, at the same places. */
INL void hsum_group(const v16* v, float* out, const int n) {
  static const int reversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  v16 a[8], b[4], c[2];
  for (int i = 0; i < n / 2; ++i) a[i] = fold8(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < n / 4; ++i) b[i] = fold4(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < n / 8; ++i) c[i] = fold2(b[2 * i], b[2 * i + 1]);
  const v16 h = fold1(c[0], c[n / 8 - 1]);
  for (int j = 0; j < n; ++j) out[j] = h[reversed[j]];
}
/* out[j] = hsum(v[j]) for n vectors. */
INL void hsum_n(const v16* v, float* out, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16) hsum_group(v + i, out + i, 16);
  for (; i + 8 <= n; i += 8) hsum_group(v + i, out + i, 8);
  for (; i < n; ++i) out[i] = hsum(v[i]);
}

typedef struct {
  int M, N, K;
  float alpha, beta;
  const float* A; /* [M, K] with row stride lda; for the outer form also [K, M] (a_transposed) */
  const float* B; /* [N, K] with row stride ldb; for the outer form [K, N] */
  float* C;       /* [M, N], row stride ldc */
  int lda, ldb, ldc;
  int a_transposed;
  const uint32_t* H; /* B's half-width copy in panels (see panel_tile) where panel_columns reads it */
} product;

/* C[r, n] = alpha * s + beta * C[r, n], with beta 0 overwriting (MLX's output buffer is
 * uninitialised: NaN * 0 would be NaN). */
INL void put(const product* p, int r, int n, float s) {
  float* c = p->C + (long)r * p->ldc + n;
  *c = p->beta == 0.0f ? p->alpha * s : p->alpha * s + p->beta * *c;
}

/* Weight row n's floats from k on, as 16 lanes. */
INL v16 weight16(const product* p, long n, int k) { return LOAD(p->B + n * p->ldb + k); }

/* put() of a dot product whose K's tail past the last 16 is added after the lane sum. */
INL void store(const product* p, int r, int n, float s, int k) {
  const float* a = p->A + (long)r * p->lda;
  for (int kk = k; kk < p->K; ++kk) s += a[kk] * p->B[(long)n * p->ldb + kk];
  put(p, r, n, s);
}

/* R rows (r0..; R <= 4, a constant once inlined) times 4 weight rows (n..): 4R accumulators that
 * stay in registers, each weight vector loaded once for all R rows. */
INL void tile(const product* p, int r0, int n, const int R) {
  const int K = p->K;
  const long ldb = p->ldb;
  const float* a = p->A + (long)r0 * p->lda;
  v16 acc[4][4];
  UNROLL for (int r = 0; r < R; ++r) {
    UNROLL for (int c = 0; c < 4; ++c) acc[r][c] = (v16){0};
  }
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    const v16 b0 = weight16(p, n, k), b1 = weight16(p, n + 1, k), b2 = weight16(p, n + 2, k),
              b3 = weight16(p, n + 3, k);
    PREFETCH(p->B + (n + 8) * ldb + k, ldb);
    UNROLL for (int r = 0; r < R; ++r) {
      const v16 x = LOAD(a + (long)r * p->lda + k);
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
      acc[r][2] += x * b2;
      acc[r][3] += x * b3;
    }
  }
  float s[16];
  hsum_n(&acc[0][0], s, 4 * R);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) store(p, r0 + r, n + c, s[4 * r + c], k);
  }
}

/* One weight row (the last N % 4) times every row. */
INL void column(const product* p, int n) {
  for (int r = 0; r < p->M; ++r) {
    const float* a = p->A + (long)r * p->lda;
    v16 acc = (v16){0};
    int k = 0;
    for (; k + 16 <= p->K; k += 16) acc += LOAD(a + k) * weight16(p, n, k);
    store(p, r, n, hsum(acc), k);
  }
}

/* Output columns [n0, n1) of the product, every row. n0 is a multiple of 4. */
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 6)
#define VECTOR_VARIANTS __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_VARIANTS /* one build: NEON on arm64 */
#endif

/* Weight rows n..n+3 times every row of A, in tiles of up to 4 rows. */
INL void every_row(const product* p, int n) {
  int r = 0;
  for (; r + 4 <= p->M; r += 4) tile(p, r, n, 4);
  switch (p->M - r) { /* each with its own constant R, so each compiles to its own unrolled loop */
    case 3: tile(p, r, n, 3); break;
    case 2: tile(p, r, n, 2); break;
    case 1: tile(p, r, n, 1); break;
    default: break;
  }
}

VECTOR_VARIANTS static void columns(const product* p, int n0, int n1) {
  int n = n0;
  for (; n + 4 <= n1; n += 4) every_row(p, n);
  for (; n < n1; ++n) column(p, n);
}

/* ---- the outer-product kernel: B stored [K, N] --------------------------------------------- */

/* The small products of a verify's attention and GDN heads (scores @ V, per-head state reads) come
 * with B stored [K, N]. They are cheap; they run here so that a decode step or a verify never
 * wakes OpenBLAS's threads, whose spinning afterwards takes the core from this file's helpers. A
 * row of C is a sum over k of A[r, k] * B[k, :], 16 columns a vector, in k's order. */
INL float a_at(const product* p, int r, int k) {
  return p->a_transposed ? p->A[(long)k * p->lda + r] : p->A[(long)r * p->lda + k];
}

INL void store_vector(const product* p, int r, int n, v16 s) {
  float* c = p->C + (long)r * p->ldc + n;
  v16 out = s * p->alpha;
  if (p->beta != 0.0f) {
    out += LOAD(c) * p->beta;
  }
  *(v16u*)c = out;
}

/* R rows (r0..) times V vectors of 16 columns (n..); R <= 4, V <= 4, constants once inlined. */
INL void outer_tile(const product* p, int r0, int n, const int R, const int V) {
  v16 acc[4][4];
  UNROLL for (int r = 0; r < R; ++r) {
    UNROLL for (int j = 0; j < V; ++j) acc[r][j] = (v16){0};
  }
  for (int k = 0; k < p->K; ++k) {
    const float* b = p->B + (long)k * p->ldb + n;
    v16 bv[4];
    UNROLL for (int j = 0; j < V; ++j) bv[j] = LOAD(b + 16 * j);
    UNROLL for (int r = 0; r < R; ++r) {
      const float a = a_at(p, r0 + r, k);
      UNROLL for (int j = 0; j < V; ++j) acc[r][j] += a * bv[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < V; ++j) store_vector(p, r0 + r, n + 16 * j, acc[r][j]);
  }
}

INL void outer_rows(const product* p, int n, const int V) {
  int r = 0;
  for (; r + 4 <= p->M; r += 4) outer_tile(p, r, n, 4, V);
  switch (p->M - r) {
    case 3: outer_tile(p, r, n, 3, V); break;
    case 2: outer_tile(p, r, n, 2, V); break;
    case 1: outer_tile(p, r, n, 1, V); break;
    default: break;
  }
}

/* Output columns [n0, n1) of an outer-form product, every row. n0 is a multiple of 16. */
VECTOR_VARIANTS static void outer_columns(const product* p, int n0, int n1) {
  int n = n0;
  for (; n + 64 <= n1; n += 64) outer_rows(p, n, 4);
  switch ((n1 - n) / 16) {
    case 3: outer_rows(p, n, 3); break;
    case 2: outer_rows(p, n, 2); break;
    case 1: outer_rows(p, n, 1); break;
    default: break;
  }
  for (n += (n1 - n) / 16 * 16; n < n1; ++n) { /* the last N % 16 columns */
    for (int r = 0; r < p->M; ++r) {
      float s = 0.0f;
      for (int k = 0; k < p->K; ++k) s += a_at(p, r, k) * p->B[(long)k * p->ldb + n];
      put(p, r, n, s);
    }
  }
}

/* ---- the panel kernel: products by a registered weight's bfloat16 copy --------------------- */

/* A registered weight's copy (spruce_half_add) is kept in panels of PANEL weight rows, which are a
 * product's output columns: panel g holds rows [32g, 32g + 32) for every k, one k after the other,
 * 64 bytes a k: 16 words whose lane j holds row 32g + j's bfloat16 in its low half and row
 * 32g + 16 + j's in its high half (rows past the weight's end are zeros). One aligned load gives the
 * 32 rows' floats at k in two more instructions (the low half shifted up, the high half masked),
 * and a panel is one sequential stream, which the hardware prefetcher follows.
 *
 * The product runs as outer products: C[r, 32g .. 32g + 32) += A[r, k] * (the panel's 32 floats at
 * k), k after k. Each output is one sum in k's order, whatever the row count, the tile or the
 * thread: batch invariant, and without the dot-product tiles' lane sums, which on a short K (the
 * bundled model's 384) cost nearly as much as the multiply-adds. A tile of R rows and G panels
 * loads each panel's 32 floats once for its R rows. Against the dot-product tiles that read the
 * copy in rows before (µs a product on one core of the dev CPU, weights from cache, 1 / 4 / 7 / 17
 * rows): 768 x 384 7.2 / 15.5 / 24.7 / 56.6 against 22.3 / 40.8 / 66.0 / 136.4, 75-95 % of the
 * core's multiply-add rate from 7 rows on; 8192 x 384 from L3, 217 / 217 / 298 / 643 against
 * 244 / 440 / 730 / 1573. */
#define PANEL 32
/* Each panel's stream is fetched this many k (64-byte lines) ahead into L2: one stream falls far
 * short of the bandwidth on the hardware prefetcher alone (dev CPU, one core, 7 rows by weights
 * from L3: 11 GB/s without, 14.7 / 21.5 / 22.8 / 21.6 GB/s at 8 / 64 / 96 / 128 ahead). */
#define PANEL_AHEAD 64
#define TILE_ROWS 12 /* rows a tile takes at most: 24 accumulators of the 32 vector registers */
#define UNROLL_ALL _Pragma("GCC unroll 16")

/* Panels a tile of R rows takes at once: enough accumulators (2RG) to cover the multiply-add's
 * latency, few enough to stay in registers. */
INL int panel_group(int R) { return R == 1 ? 8 : R == 2 ? 6 : R == 3 ? 4 : R == 4 ? 3 : R <= 6 ? 2 : 1; }

/* Rows r0 .. r0 + R times panels g0 .. g0 + G (R, G constants once inlined). */
INL void panel_tile(const product* p, int r0, int g0, const int R, const int G) {
  v16 acc[TILE_ROWS][8][2];
  UNROLL_ALL for (int r = 0; r < R; ++r) {
    UNROLL_ALL for (int g = 0; g < G; ++g) acc[r][g][0] = acc[r][g][1] = (v16){0};
  }
  const long panel_words = 16L * p->K;
  const uint32_t* w = p->H + g0 * panel_words;
  const float* a = p->A + (long)r0 * p->lda;
  for (int k = 0; k < p->K; ++k) {
    UNROLL_ALL for (int g = 0; g < G; ++g) {
      __builtin_prefetch(w + g * panel_words + 16L * (k + PANEL_AHEAD), 0, 2);
      const v16w d = *(const v16w*)(w + g * panel_words + 16L * k);
      const v16 lo = (v16)(d << 16), hi = (v16)(d & 0xffff0000u);
      UNROLL_ALL for (int r = 0; r < R; ++r) {
        const float x = a[(long)r * p->lda + k];
        acc[r][g][0] += x * lo;
        acc[r][g][1] += x * hi;
      }
    }
  }
  UNROLL_ALL for (int r = 0; r < R; ++r) {
    UNROLL_ALL for (int g = 0; g < G; ++g) {
      const int n = (g0 + g) * PANEL;
      if (n + PANEL <= p->N) {
        store_vector(p, r0 + r, n, acc[r][g][0]);
        store_vector(p, r0 + r, n + 16, acc[r][g][1]);
      } else { /* the last panel's rows past N */
        for (int j = 0; j < 16 && n + j < p->N; ++j) put(p, r0 + r, n + j, acc[r][g][0][j]);
        for (int j = 0; j < 16 && n + 16 + j < p->N; ++j) put(p, r0 + r, n + 16 + j, acc[r][g][1][j]);
      }
    }
  }
}

/* panel_tile with the row count as a constant: `G` panels, or one. */
#define PANEL_CASE(R)                                             \
  case R:                                                         \
    if (G == 1) {                                                 \
      panel_tile(p, r0, g, R, 1);                                 \
    } else {                                                      \
      panel_tile(p, r0, g, R, panel_group(R));                    \
    }                                                             \
    break;
INL void panel_rows(const product* p, int r0, int g, int rows, int G) {
  switch (rows) {
    PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6)
    PANEL_CASE(7) PANEL_CASE(8) PANEL_CASE(9) PANEL_CASE(10) PANEL_CASE(11) PANEL_CASE(12)
    default: break;
  }
}

/* The tiles' shape for M rows: the rows cut into tiles of at most TILE_ROWS, as even as can be
 * (13 rows as 7 + 6), and the panels a tile takes at once. Beyond one tile a tile has 7 rows or
 * more, which take one panel at a time. */
INL int panel_tile_rows(int M) {
  const int tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
  return (M + tiles - 1) / tiles;
}

/* Output columns [n0, n1) of a product by a panel copy, every row. n0 is a multiple of
 * PANEL * panel_group(panel_tile_rows(M)). */
VECTOR_VARIANTS static void panel_columns(const product* p, int n0, int n1) {
  const int R = panel_tile_rows(p->M), G = panel_group(R);
  const int g1 = (n1 + PANEL - 1) / PANEL;
  int g = n0 / PANEL;
  for (; g + G <= g1; g += G) {
    for (int r0 = 0; r0 < p->M; r0 += R) panel_rows(p, r0, g, p->M - r0 < R ? p->M - r0 : R, G);
  }
  for (; g < g1; ++g) { /* the last panels, one at a time */
    for (int r0 = 0; r0 < p->M; r0 += R) panel_rows(p, r0, g, p->M - r0 < R ? p->M - r0 : R, 1);
  }
}

/* ---- the helper threads -------------------------------------------------------------------- */

/* A product is cut into blocks of columns that the calling thread and the helpers claim one at a
 * time, so a helper the OS has not scheduled yet only means the caller does more of the blocks.
 * The caller returns once every block is claimed and no helper is inside one. Helpers spin a
 * while between products (a forward pass calls dozens back to back) and then sleep on a futex. */
#define MAX_THREADS 16
/* A claim past every block: a helper that wakes late, between products, claims nothing. */
#define CLOSED (INT_MAX / 2)
#define SPINS 20000 /* sched_yield calls: tens of microseconds when nothing else wants the core */

typedef void (*kernel_fn)(const product*, int, int); /* columns [n0, n1) of every row */
/* Items [i0, i1) of a job: a product's columns, or any other caller's work (spruce_parallel). */
typedef void (*task_fn)(void*, int, int);

static struct {
  pthread_mutex_t busy; /* one job at a time; a second caller computes alone */
  pthread_once_t once;
  int helpers;
  int threads; /* threads this job may use, the caller's included: helpers of index >= threads - 1 sit it out */
  product job; /* a product's operands, read by product_task */
  kernel_fn kernel;
  task_fn task; /* what a claimed block runs, on ctx */
  void* ctx;
  int items; /* the job's items: a product's columns */
  int block;
  int blocks;          /* read by helpers before they own a block: atomic */
  unsigned generation; /* futex word: bumped once a job is set up */
  int next;            /* next block to claim; CLOSED between jobs */
  int active;          /* helpers inside a block */
  int sleeping;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_ONCE_INIT, 0, 1, {0}, 0, 0, 0, 0, 0, 0, 0, CLOSED, 0, 0};

static void run_blocks(void) {
  for (;;) {
    const int i = __atomic_fetch_add(&pool.next, 1, __ATOMIC_ACQ_REL);
    if (i >= __atomic_load_n(&pool.blocks, __ATOMIC_RELAXED)) {
      return;
    }
    const int n0 = i * pool.block;
    const int n1 = n0 + pool.block < pool.items ? n0 + pool.block : pool.items;
    pool.task(pool.ctx, n0, n1);
  }
}

static void product_task(void* ctx, int n0, int n1) {
  (void)ctx;
  pool.kernel(&pool.job, n0, n1);
}

static void* helper(void* arg) {
  const int index = (int)(long)arg;
  unsigned seen = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
  for (;;) {
    unsigned now = seen;
    for (int spin = 0; spin < SPINS && now == seen; ++spin) {
      sched_yield();
      now = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
    }
    if (now == seen) {
      __atomic_add_fetch(&pool.sleeping, 1, __ATOMIC_ACQ_REL);
      syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
      __atomic_sub_fetch(&pool.sleeping, 1, __ATOMIC_ACQ_REL);
      continue; /* woken, or the word had already moved: look again */
    }
    seen = now;
    if (index >= __atomic_load_n(&pool.threads, __ATOMIC_RELAXED) - 1) {
      continue;
    }
    __atomic_add_fetch(&pool.active, 1, __ATOMIC_ACQ_REL);
    run_blocks();
    __atomic_sub_fetch(&pool.active, 1, __ATOMIC_ACQ_REL);
  }
  return NULL;
}

/* Threads: SPRUCE_GEMM_THREADS, else OPENBLAS_NUM_THREADS or OMP_NUM_THREADS where set (the tests
 * pin them), else the CPUs this process may run on. */
static int thread_count(void) {
  const char* names[] = {"SPRUCE_GEMM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"};
  for (int i = 0; i < 3; ++i) {
    const char* v = getenv(names[i]);
    if (v != NULL && atoi(v) > 0) {
      return atoi(v) < MAX_THREADS ? atoi(v) : MAX_THREADS;
    }
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    return 1;
  }
  const int n = CPU_COUNT(&set);
  return n < 1 ? 1 : n < MAX_THREADS ? n : MAX_THREADS;
}

static void start_helpers(void) {
  const int want = thread_count() - 1;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  for (int i = 0; i < want; ++i) {
    pthread_t t;
    if (pthread_create(&t, &attr, helper, (void*)(long)pool.helpers) == 0) {
      pool.helpers += 1;
    }
  }
  pthread_attr_destroy(&attr);
}

/* The pool's threads as this job may use them: SPRUCE_GEMM_THREADS' limit where set, else every
 * helper and the caller. Starts the helpers on first use. */
static int pool_threads(void) {
  const int limit = __atomic_load_n(&spruce_gemm_threads, __ATOMIC_RELAXED);
  if (limit == 1) {
    return 1;
  }
  pthread_once(&pool.once, start_helpers);
  return limit > 1 && limit <= pool.helpers ? limit : pool.helpers + 1;
}

/* Blocks of `block` items of a job on this thread and `threads` - 1 helpers; 0 where the pool is
 * busy with another caller's job (the caller then runs it alone). Set up before the claims open:
 * no helper reads the job until it claims a block below `blocks`, which the release of `next`
 * orders after the set-up, and the last job closed `next`, so until then every claim fails. */
static int run_pooled(task_fn task, void* ctx, const product* p, kernel_fn kernel, int items, int block,
                      int threads) {
  if (pthread_mutex_trylock(&pool.busy) != 0) {
    return 0;
  }
  __atomic_store_n(&pool.threads, threads, __ATOMIC_RELAXED); /* published by the generation's bump */
  if (p != NULL) {
    pool.job = *p;
    pool.kernel = kernel;
  }
  pool.task = task;
  pool.ctx = ctx;
  pool.items = items;
  pool.block = block;
  __atomic_store_n(&pool.blocks, (items + block - 1) / block, __ATOMIC_RELAXED);
  __atomic_store_n(&pool.next, 0, __ATOMIC_RELEASE);
  __atomic_add_fetch(&pool.generation, 1, __ATOMIC_ACQ_REL);
  if (__atomic_load_n(&pool.sleeping, __ATOMIC_ACQUIRE) > 0) {
    syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
  }
  run_blocks();
  while (__atomic_load_n(&pool.active, __ATOMIC_ACQUIRE) > 0) {
    sched_yield(); /* a helper is finishing its last block */
  }
  __atomic_store_n(&pool.next, CLOSED, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&pool.busy);
  return 1;
}

/* The product on this thread and the helpers, `kernel` over blocks of columns that are multiples
 * of `align` (its widest step). */
static void pooled(const product* p, kernel_fn kernel, int align) {
  const long macs = (long)p->M * p->N * p->K;
  int threads = 1, block = p->N;
  if (macs >= THREADED_MACS) {
    threads = pool_threads();
    /* ~4 blocks a thread, whole steps of the kernel */
    block = (p->N + 4 * threads - 1) / (4 * threads);
    block = (block + align - 1) / align * align;
  }
  /* alone: a small product, one thread, a product of one block (not worth a wake-up), or the pool
   * busy with another caller's job */
  if (threads == 1 || block >= p->N || !run_pooled(product_task, NULL, p, kernel, p->N, block, threads)) {
    kernel(p, 0, p->N);
  }
}

/* Items [0, n) of another library's job (engine/cpu_ext.cpp: attention's rows), one item a claim,
 * on this thread and the pool's helpers; alone where the pool is busy or limited to one thread.
 * `task` must give the same results whichever thread runs an item. */
void spruce_parallel(task_fn task, void* ctx, int n) {
  const int threads = n > 1 ? pool_threads() : 1;
  if (threads == 1 || !run_pooled(task, ctx, NULL, NULL, n, 1, threads)) {
    task(ctx, 0, n);
  }
}

/* ---- half-width copies of registered weights ------------------------------------------------ */

/* An open-addressed table keyed by the weight's address (MLX hands a linear layer's weight buffer
 * to cblas_sgemm as B, transposed). Entries are written by spruce_half_add / spruce_half_remove on
 * the Python side, one caller at a time (engine/half_weights.py holds a lock), and read by any
 * thread without a lock: an entry's fields are set before its key is published, and a removed key
 * becomes REMOVED (kept, so that probes past it go on), so a lookup never sees a half-written
 * entry. engine/half_weights.py keeps each registered array alive until it is removed, so an
 * address cannot be reused by another array while its entry stands.
 *
 * Removed keys fill the table as models come and go (the test suite loads hundreds), so when an
 * insert finds it half full, the live entries move to a fresh table, published whole with one
 * atomic store. The old table is never freed: a lookup that started in it may still be reading it
 * (4096 entries, 96 kB, once every thousand or so removals). */
#define HALF_SLOTS 4096 /* at most half of them hold keys */
#define REMOVED ((const float*)1)

typedef struct {
  const float* w; /* key: NULL empty, REMOVED */
  uint32_t* h;    /* the copy in panels (see panel_tile) */
  int n, k;       /* rows and columns */
  long ld;        /* row stride of both, in elements */
} half_entry;

typedef struct {
  half_entry slot[HALF_SLOTS];
  int used; /* slots holding a key, REMOVED ones included */
} half_table;

static half_table first_table;
static half_table* half_live = &first_table;

static unsigned half_slot(const float* w) { return (unsigned)(((uintptr_t)w >> 6) * 2654435761u) % HALF_SLOTS; }

/* w's entry in t, or NULL. */
static half_entry* find_entry(half_table* t, const float* w) {
  for (unsigned i = half_slot(w), probes = 0; probes < HALF_SLOTS; i = (i + 1) % HALF_SLOTS, ++probes) {
    const float* key = __atomic_load_n(&t->slot[i].w, __ATOMIC_ACQUIRE);
    if (key == NULL) {
      return NULL;
    }
    if (key == w) {
      return &t->slot[i];
    }
  }
  return NULL;
}

/* B's half-width copy where B is a registered weight read in full rows: the first N rows (a view of
 * a weight's leading rows, such as a draft vocabulary's slice of the output embedding, reads the
 * copy's first rows) of K columns at the registered stride; else NULL. */
static const uint32_t* half_copy(const float* b, int N, int K, int ldb) {
  const half_entry* e = find_entry(__atomic_load_n(&half_live, __ATOMIC_ACQUIRE), b);
  return e != NULL && N <= e->n && K == e->k && ldb == e->ld ? e->h : NULL;
}

/* The slot an insert of w takes in t: the first empty or removed one of its probe. */
static unsigned free_slot(const half_table* t, const float* w) {
  unsigned i = half_slot(w);
  while (t->slot[i].w != NULL && t->slot[i].w != REMOVED) {
    i = (i + 1) % HALF_SLOTS;
  }
  return i;
}

/* Move the live entries to a fresh table and publish it: 0 where no memory could be had. */
static int rebuild(void) {
  half_table* fresh = calloc(1, sizeof(half_table));
  if (fresh == NULL) {
    return 0;
  }
  const half_table* old = half_live;
  for (int i = 0; i < HALF_SLOTS; ++i) {
    const half_entry* e = &old->slot[i];
    if (e->w != NULL && e->w != REMOVED) {
      fresh->slot[free_slot(fresh, e->w)] = *e;
      fresh->used += 1;
    }
  }
  __atomic_store_n(&half_live, fresh, __ATOMIC_RELEASE);
  return 1;
}

/* Register weight w ([n, k], row stride ld floats): 1 when it is (now or already) registered, 0
 * when some value is not a bfloat16 (low 16 bits not zero) or the shape is not one a product can
 * take, -1 when the table or the memory is full. */
int spruce_half_add(const float* w, int n, int k, long ld) {
  if (w == NULL || n < 1 || k < 1 || ld < k) {
    return 0;
  }
  if (half_copy(w, n, k, (int)ld) != NULL) {
    return 1;
  }
  for (long r = 0; r < n; ++r) {
    const uint32_t* row = (const uint32_t*)(w + r * ld);
    for (int c = 0; c < k; ++c) {
      if ((row[c] & 0xffffu) != 0) {
        return 0;
      }
    }
  }
  half_table* t = half_live;
  unsigned i = free_slot(t, w);
  if (t->slot[i].w == NULL && t->used + 1 > HALF_SLOTS / 2) { /* full of keys, removed ones too */
    if (!rebuild()) {
      return -1;
    }
    t = half_live;
    i = free_slot(t, w);
    if (t->slot[i].w == NULL && t->used + 1 > HALF_SLOTS / 2) { /* full of live keys */
      return -1;
    }
  }
  const long panels = (n + PANEL - 1) / PANEL;
  uint32_t* h = aligned_alloc(64, sizeof(uint32_t) * 16 * (size_t)k * (size_t)panels); /* 64 bytes a k */
  if (h == NULL) {
    return -1;
  }
  for (long g = 0; g < panels; ++g) {
    for (long j = 0; j < 16; ++j) {
      const long lo = g * PANEL + j, hi = lo + 16; /* the weight rows of lane j's low and high halves */
      const uint32_t* lo_row = (const uint32_t*)(w + lo * ld);
      const uint32_t* hi_row = (const uint32_t*)(w + hi * ld);
      uint32_t* out = h + g * 16L * k + j;
      for (long c = 0; c < k; ++c) {
        out[16 * c] = (hi < n ? hi_row[c] & 0xffff0000u : 0) | (lo < n ? lo_row[c] >> 16 : 0);
      }
    }
  }
  if (t->slot[i].w == NULL) {
    t->used += 1;
  }
  t->slot[i].h = h;
  t->slot[i].n = n;
  t->slot[i].k = k;
  t->slot[i].ld = ld;
  __atomic_store_n(&t->slot[i].w, w, __ATOMIC_RELEASE);
  return 1;
}

/* Forget weight w and free its copy: 1 if it was registered. The caller makes sure no product by it
 * is running (engine/half_weights.py synchronizes MLX first). */
int spruce_half_remove(const float* w) {
  half_entry* e = find_entry(half_live, w);
  if (e == NULL) {
    return 0;
  }
  __atomic_store_n(&e->w, REMOVED, __ATOMIC_RELEASE);
  free(e->h);
  e->h = NULL;
  return 1;
}

/* ---- the entry point ----------------------------------------------------------------------- */

__attribute__((constructor)) static void find_next(void) {
  next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
  next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
  const char* rows = getenv("SPRUCE_SMALL_ROWS");
  if (rows != NULL && *rows != '\0') {
    spruce_small_rows = atoi(rows) < 0 ? 0 : atoi(rows);
  }
}

/* y = 0 where beta is 0: the output MLX hands over is uninitialised memory, and a BLAS may scale
 * it by beta (NaN * 0 is NaN) instead of overwriting it. */
static void clear_if_overwritten(float beta, float* y, int n, int inc) {
  if (beta == 0.0f) {
    for (int i = 0; i < n; ++i) {
      y[(long)i * inc] = 0.0f;
    }
  }
}

/* One row of A (or, transposed, one column) times op(B) into one row of C. */
static void row_times_b(int trans_a, int trans_b, int r, int N, int K, float alpha, const float* A, int lda,
                        const float* B, int ldb, float beta, float* C, int ldc) {
  const float* a = trans_a == NO_TRANS ? A + (long)r * lda : A + r;
  const int inc_a = trans_a == NO_TRANS ? 1 : lda;
  float* c = C + (long)r * ldc;
  clear_if_overwritten(beta, c, N, 1);
  if (trans_b == NO_TRANS) {
    next_sgemv(ROW_MAJOR, TRANS, K, N, alpha, B, ldb, a, inc_a, beta, c, 1); /* B stored [K, N] */
  } else {
    next_sgemv(ROW_MAJOR, NO_TRANS, N, K, alpha, B, ldb, a, inc_a, beta, c, 1); /* B stored [N, K] */
  }
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc) {
  const int rows_limit = __atomic_load_n(&spruce_small_rows, __ATOMIC_RELAXED);
  if (order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == TRANS && M >= 1 && M <= rows_limit && N >= 1 &&
      K >= 1 && __atomic_load_n(&spruce_half, __ATOMIC_RELAXED)) {
    const uint32_t* h = half_copy(B, N, K, ldb);
    if (h != NULL) { /* x @ W.T by a registered weight: from its half-width copy, one row included */
      const product p = {M, N, K, alpha, beta, A, B, C, lda, ldb, ldc, 0, h};
      pooled(&p, panel_columns, PANEL * panel_group(panel_tile_rows(M)));
      __atomic_add_fetch(&spruce_half_calls, 1, __ATOMIC_RELAXED);
      return;
    }
  }
  const int small = order == ROW_MAJOR && M >= 1 && N >= 1 && K >= 1 && M <= rows_limit;
  if (small && trans_a == NO_TRANS && trans_b == TRANS) { /* x @ W.T: a linear layer */
    const product p = {M, N, K, alpha, beta, A, B, C, lda, ldb, ldc, 0, NULL};
    pooled(&p, columns, 4);
    __atomic_add_fetch(&spruce_gemv_calls, 1, __ATOMIC_RELAXED);
    return;
  }
  if (small && trans_b == NO_TRANS) { /* B stored [K, N]: attention's scores @ V, the GDN heads' */
    const product p = {M, N, K, alpha, beta, A, B, C, lda, ldb, ldc, trans_a != NO_TRANS, NULL};
    pooled(&p, outer_columns, 16);
    __atomic_add_fetch(&spruce_gemv_calls, 1, __ATOMIC_RELAXED);
    return;
  }
  if (order == ROW_MAJOR && next_sgemv != 0 && K > 0 && M >= 1 && M <= GEMV_ROWS) {
    for (int r = 0; r < M; ++r) {
      row_times_b(trans_a, trans_b, r, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    }
    __atomic_add_fetch(&spruce_gemv_calls, M, __ATOMIC_RELAXED);
    return;
  }
  if (order == ROW_MAJOR && next_sgemv != 0 && K > 0 && N == 1) {
    /* C[M, 1] = alpha op(A) b + beta C: b is B's one column (or, transposed, its one row) */
    const int inc_b = trans_b == NO_TRANS ? ldb : 1;
    clear_if_overwritten(beta, C, M, ldc);
    if (trans_a == NO_TRANS) {
      next_sgemv(ROW_MAJOR, NO_TRANS, M, K, alpha, A, lda, B, inc_b, beta, C, ldc); /* A stored [M, K] */
    } else {
      next_sgemv(ROW_MAJOR, TRANS, K, M, alpha, A, lda, B, inc_b, beta, C, ldc); /* A stored [K, M] */
    }
    __atomic_add_fetch(&spruce_gemv_calls, 1, __ATOMIC_RELAXED);
    return;
  }
  next_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
