// RMSNorm over rows (norm.h's RmsNormArgs): the torch form of nn.layers.RMSNorm in one pass a
// row, for a step's few rows, where the torch form is ~10 ops of a few microseconds each.
// Per row: r = 1 / sqrt(sum(x^2) / D + eps) in float32 (the sum in 8 lanes, a fixed order: the
// bits depend neither on the thread count nor on the rows beside it), then
//   zero-centred: y = (x r) (1 + w);  plain: y = w (x r), with x r rounded to bf16 first in a
// bf16 model, as its torch form rounds. With a residual r: x + r (one add, stored in x's dtype)
// is written out and normed, the block's residual add and the next norm in one pass.
// Built with -mavx2 -mfma; the launcher checks the CPU.
#include "bf16.h"
#include "flashrt.h"
#include "vec_avx2.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#ifdef FLASHRT_OPENMP
#include <omp.h>
#endif

namespace flashrt {
namespace {

inline void put(float* y, float v) { *y = v; }
inline void put(uint16_t* y, float v) { *y = to_bf16(v); }
inline float as_stored(float v, const float*) { return v; }
inline float as_stored(float v, const uint16_t*) { return round_bf16(v); }

// Sum of squares of D values widened to float32: lane j takes k = j, j + 8, ..., then the tail.
inline float sum_squares(const float* x, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= D; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum(acc);
  for (; k < D; ++k) s += x[k] * x[k];
  return s;
}
inline float sum_squares(const uint16_t* x, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= D; k += 8) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k)));
    const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum(acc);
  for (; k < D; ++k) s += widen(x[k]) * widen(x[k]);
  return s;
}

template <typename X, typename W>
void rows(const RmsNormArgs& a, int64_t m0, int64_t m1) {
  const X* x = static_cast<const X*>(a.x);
  const W* w = static_cast<const W*>(a.w);
  X* y = static_cast<X*>(a.y);
  const int64_t D = a.D;
  for (int64_t m = m0; m < m1; ++m) {
    const X* xm = x + m * D;
    X* ym = y + m * D;
    if (a.r != nullptr) {                      // the residual sum first, as stored; then its norm
      const X* rm = static_cast<const X*>(a.r) + m * D;
      X* sm = static_cast<X*>(a.s) + m * D;
      for (int64_t k = 0; k < D; ++k) put(sm + k, widen(xm[k]) + widen(rm[k]));
      xm = sm;
    }
    const float r = 1.0f / std::sqrt(sum_squares(xm, D) / static_cast<float>(D) + a.eps);
    if (a.zero_centred) {
      for (int64_t k = 0; k < D; ++k) put(ym + k, (widen(xm[k]) * r) * (1.0f + widen(w[k])));
    } else {
      for (int64_t k = 0; k < D; ++k) put(ym + k, widen(w[k]) * as_stored(widen(xm[k]) * r, xm));
    }
  }
}

template <typename X, typename W>
void run(const RmsNormArgs& a, int num_threads) {
#ifdef FLASHRT_OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();
  // a prefill chunk's rows split over threads; a step's few rows are cheaper than a fork/join
  if (num_threads > 1 && a.M * a.D >= (int64_t{1} << 16) && !forked_after_load()) {
#pragma omp parallel num_threads(num_threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      rows<X, W>(a, a.M * t / nt, a.M * (t + 1) / nt);
    }
    return;
  }
#else
  (void)num_threads;
#endif
  rows<X, W>(a, 0, a.M);
}

}  // namespace

void rms_norm_cpu(const RmsNormArgs& a, int num_threads) {
  if (a.bf16_x) {
    if (a.bf16_w) return run<uint16_t, uint16_t>(a, num_threads);
    return run<uint16_t, float>(a, num_threads);
  }
  if (a.bf16_w) return run<float, uint16_t>(a, num_threads);
  run<float, float>(a, num_threads);
}

}  // namespace flashrt
