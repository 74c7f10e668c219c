/* cblas_sgemm for MLX's Linux CPU backend, with products of a few rows (or one column) sent to
 * cblas_sgemv, a row at a time.
 *
 * Why: MLX's CPU matmul calls cblas_sgemm for every float32 product (mlx 0.32,
 * mlx/backend/cpu/gemms/cblas.cpp), and OpenBLAS 0.3.21 (Debian 12's) runs a one-row product
 * through its full GEMM: it packs the whole weight into panels first and then reads it again. A decode step multiplies one row by every weight, so that packing is most of
 * its matmul time: the bundled model's output projection (8192 x 384) took ~470 us as a GEMM
 * against ~105 us as a GEMV on the dev CPU. engine/blas.py builds this file once per user with
 * the C compiler on PATH and preloads it ahead of OpenBLAS; every other product goes to the next
 * cblas_sgemm in the search order (OpenBLAS's) unchanged.
 *
 * A GEMV sums in another order than a GEMM row, so a one-row product may round differently from
 * the same row inside a product of more than GEMV_ROWS rows (as OpenBLAS's GEMM already does
 * between thread counts): within float32 rounding, which the engine's losslessness rule allows for.
 */
#define _GNU_SOURCE
#include <dlfcn.h>

enum { ROW_MAJOR = 101 };
enum { NO_TRANS = 111, TRANS = 112 };

/* Products of up to this many rows run as one GEMV a row. On the dev CPU (OpenBLAS 0.3.21, two
 * threads; an ad-hoc timing of MLX products, µs, GEMM against separate one-row GEMVs): 8192 x 384 at
 * 2 / 4 / 7 rows 561 / 804 / 775 against ~230 / ~460 / ~805; 768 x 384 69 / 84 / 80 against ~40 /
 * ~80 / ~140. So up to 4 rows a row at a time (scripts/bench_gemv_shim.py times the landed form),
 * and such a product's rows are each bitwise what the row alone gives: a verify of up to 4 rows
 * rounds as the one-row steps do. */
#define GEMV_ROWS 4

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                         float*, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

/* How many products this file sent to cblas_sgemv (read by the tests through ctypes). */
long spruce_gemv_calls;

__attribute__((constructor)) static void find_next(void) {
  next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
  next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
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
