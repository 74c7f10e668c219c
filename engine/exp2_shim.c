/* powf(2, y) answered by exp2f(y), for MLX's Linux CPU backend; linked into the GEMV shim's library
 * (engine/gemv_shim.c, built and preloaded by engine/blas.py).
 *
 * Why: on the CPU the engine spells every exponential as a power of two (engine/cpu_exp.py: a
 * softmax's, the SiLU and sigmoid gates'), because MLX's own exp is a scalar polynomial at ~15 ns an
 * element there and its power calls libm's powf at ~4 ns. glibc's powf works for any base (a log
 * and an exp); its exp2f does only the exp, at ~1.5 ns an element on the dev CPU. A decode step's
 * attention over 4,000 cached keys takes 24,000 exponentials a layer: its softmax took 168 µs with
 * powf and 115 with exp2f.
 *
 * Same bits: glibc's powf and exp2f (2.28 on) both work in double precision and round once to
 * float, and for base 2 the log is exact, so powf(2, y) and exp2f(y) came out the same float for
 * all 2^32 inputs on glibc 2.36 (scripts/check_pow2.py). Another libm need not agree: at load, a
 * sample of 69,632 inputs spread over every exponent, and dense where a softmax's exponents lie, is
 * checked, and any difference leaves every powf to libm. So outputs do not change, only their speed.
 *
 * spruce_pow2: 1 on (the default), 0 off (SPRUCE_POW2=0 at start, or set through ctypes), 2 on and
 * counting the calls it answers in spruce_pow2_calls (tests: that MLX's power reaches this file; a
 * shared counter costs every call a contended write, hence not by default). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float (*powf_fn)(float, float);
static powf_fn next_powf;

int spruce_pow2 = 1;
int spruce_pow2_checked = 0; /* 1 once the load-time check passed; -1 where it failed */
long spruce_pow2_calls;

float powf(float x, float y) {
  const int mode = __atomic_load_n(&spruce_pow2, __ATOMIC_RELAXED);
  if (x == 2.0f && mode > 0) {
    if (mode == 2) {
      __atomic_add_fetch(&spruce_pow2_calls, 1, __ATOMIC_RELAXED);
    }
    return exp2f(y);
  }
  return next_powf != 0 ? next_powf(x, y) : (float)pow((double)x, (double)y); /* no libm: not seen */
}

static int same_float(float a, float b) {
  if (isnan(a) && isnan(b)) {
    return 1;
  }
  uint32_t ua, ub;
  memcpy(&ua, &a, sizeof ua);
  memcpy(&ub, &b, sizeof ub);
  return ua == ub;
}

/* Every 65,537th bit pattern (all signs and exponents), then 4,096 exponents evenly over
 * [-32, 0), where a softmax's shifted scores and the gates' arguments mostly fall. */
static int agrees(void) {
  for (uint64_t i = 0; i < 65536; ++i) {
    const uint32_t bits = (uint32_t)(i * 65537u);
    float y;
    memcpy(&y, &bits, sizeof y);
    if (!same_float(next_powf(2.0f, y), exp2f(y))) {
      return 0;
    }
  }
  for (int i = 0; i < 4096; ++i) {
    const float y = -32.0f + (float)i / 128.0f + 0.0039f;
    if (!same_float(next_powf(2.0f, y), exp2f(y))) {
      return 0;
    }
  }
  return 1;
}

__attribute__((constructor)) static void find_next_powf(void) {
  next_powf = (powf_fn)dlsym(RTLD_NEXT, "powf"); /* libm: this library links it */
  const char* mode = getenv("SPRUCE_POW2");
  if (mode != NULL && *mode != '\0') {
    spruce_pow2 = atoi(mode);
  }
  spruce_pow2_checked = next_powf != 0 && agrees() ? 1 : -1;
  if (spruce_pow2_checked < 0) {
    spruce_pow2 = 0;
  }
}
