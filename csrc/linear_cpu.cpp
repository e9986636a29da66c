// y = x w^T for a few rows of x (float32, AVX2 + FMA): the projections of a
// short step (a 16-token user turn after a capsule restore, a speculative
// verify of k+1 tokens). At M = 2..32 oneDNN's and MKL's GEMMs run far below
// both the memory and the FMA limit (measured on a 2-core EPYC, (3584, 1024)
// weights streamed from DRAM: 5-6 GB/s of weights at M = 16, against 12-14
// GB/s at M = 1), because they pack the weights per call. Here every weight
// row is read once, straight from its (out, in) layout, and reused for all
// rows of x from L1: a 3 x 4 tile of dot products keeps 12 accumulators,
// 3 x vectors and 1 weight vector in the 16 AVX2 registers.
//
// Built with -mavx2 -mfma on x86-64 only, so this file holds no code that runs before the
// launcher has checked the CPU (no static initializers, no CPU test of its own).
// Threads split the output columns (one OpenMP region on torch's threads,
// like segcopy_cpu.cpp). Each output is one sum in a fixed order over k, so
// results do not depend on the thread count.
#include "flashrt.h"

#include <immintrin.h>

#include <algorithm>

#ifdef FLASHRT_OPENMP
#include <omp.h>
#endif

namespace flashrt {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m * ldy + n] = dot(x row m, w row n) for an MR x NR tile; x and w rows are K floats apart.
template <int MR, int NR>
inline void tile(const float* x, const float* w, float* y, int64_t K, int64_t ldy) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t{7};
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int n = 0; n < NR; ++n) {
      const __m256 wv = _mm256_loadu_ps(w + n * K + k);
      for (int m = 0; m < MR; ++m) acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t k = K8; k < K; ++k) s += x[m * K + k] * w[n * K + k];
      y[m * ldy + n] = s;
    }
}

// All M rows of x against NR rows of w (the weight rows stay in L1 across the row tiles).
template <int NR>
inline void column_block(const float* x, int64_t M, const float* w, float* y, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<3, NR>(x + m * K, w, y + m * N, K, N);
  if (M - m == 2) tile<2, NR>(x + m * K, w, y + m * N, K, N);
  if (M - m == 1) tile<1, NR>(x + m * K, w, y + m * N, K, N);
}

void block(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t b) {
  constexpr int64_t NR = 4;
  const int64_t n0 = b * NR;
  const float* wb = w + n0 * K;
  float* yb = y + n0;
  switch (std::min(NR, N - n0)) {
    case 4: column_block<4>(x, M, wb, yb, K, N); break;
    case 3: column_block<3>(x, M, wb, yb, K, N); break;
    case 2: column_block<2>(x, M, wb, yb, K, N); break;
    default: column_block<1>(x, M, wb, yb, K, N); break;
  }
}

}  // namespace

void small_m_linear(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                    int num_threads) {
  const int64_t blocks = (N + 3) / 4;
#ifdef FLASHRT_OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();   // torch.set_num_threads sets it
  if (num_threads > 1 && !forked_after_load()) {   // a forked child runs serially
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) block(x, w, y, M, N, K, b);
    return;
  }
#else
  (void)num_threads;
#endif
  for (int64_t b = 0; b < blocks; ++b) block(x, w, y, M, N, K, b);
}

}  // namespace flashrt
