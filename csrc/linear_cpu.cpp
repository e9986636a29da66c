// y = x w^T for a few rows of x (x float32, w float32 or bf16; AVX2 + FMA): the projections of a
// short step (a 16-token user turn after a capsule restore, a speculative
// verify of k+1 tokens). At M = 2..32 oneDNN's and MKL's GEMMs pack the
// weights per call and stream them at 5-6 GB/s. Here every weight row is read
// once, straight from its (out, in) layout: a 3 x 4 tile of dot products keeps
// 12 accumulators, 3 x vectors and 1 weight vector in the 16 AVX2 registers.
//
// At M = 16 the step is as much FMA work as weight traffic (8 flop per weight
// byte), so the two must overlap: each thread walks its own run of 4-row
// weight blocks, prefetches the block two ahead into L2 spread over the
// current block's work, and runs the k loop in chunks so the chunk of x and
// of the 4 weight rows stays in L1 across the row tiles (vector partial sums
// wait in a small buffer between chunks).
//
// bf16 weights (a bf16 model; x stays float32): each 8-weight load widens to float32 (a shift
// of the 16 bits), then the same FMA tile; half the bytes stream, where oneDNN's bf16 GEMV reaches 12-14 GB/s.
// int8 weights (load(..., weights="int8")): widened to float32 the same way (sign-extend,
// convert: exact), the row's bf16 scale applied once to each output's sum.
//
// A bf16 model's decode step (gemv_bf16): x widened once, y rounded to bf16 as it is written, so
// the step makes no float32 copies of either; the same bits as the float32 call plus torch's casts.
// One row (a decode step) is a GEMV: no x reuse, so no tile; threads take runs of weight rows
// (GEMV_CHUNK_BYTES) in turn, GEMV_ROWS rows at a time with one vector sum per row (their
// independent FMA chains keep enough loads in flight), x staying in L1.
//
// Built with -mavx2 -mfma on x86-64 only, so this file holds no code that runs before the
// launcher has checked the CPU (no static initializers, no CPU test of its own).
// Each output is one sum in a fixed order over k (lane j of the vector sum
// takes k = j, j+8, ... in order, whatever the chunking or traversal: tile or
// GEMV), so results depend neither on the thread count nor on the batch.
#include "bf16.h"
#include "flashrt.h"
#include "vec_avx2.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef FLASHRT_OPENMP
#include <omp.h>
#endif

namespace flashrt {
namespace {

constexpr int NR = 4;            // weight rows per block
constexpr int MR = 3;            // x rows per tile
constexpr int64_t M_GROUP = 32;  // x rows per pass over a block (bounds the partial-sum buffer)
constexpr int64_t PF_AHEAD = 2;  // prefetch distance in blocks

// 8 weights as float32: float32 as stored, bf16 (its upper 16 bits) widened exactly.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
using flashrt::widen;   // bf16.h's float and bf16 forms beside the int8 one (not hidden by it)
inline float widen(int8_t w) { return static_cast<float>(w); }

// One output from its 8-lane vector sum over k < K8: the lanes added in a fixed tree, the k
// tail in order, then the int8 row's scale (scale null: none). Both traversals end here.
template <typename W>
inline float finish(__m256 acc, const float* x, const W* w, int64_t K8, int64_t K,
                    const uint16_t* scale) {
  float s = hsum(acc);
  for (int64_t k = K8; k < K; ++k) s += x[k] * widen(w[k]);
  return scale ? s * widen(*scale) : s;
}

// Walks a weight block's lines into L2, one 64-byte line every `every` k-steps.
struct Prefetch {
  const char* p = nullptr;
  const char* end = nullptr;
  int every = 1 << 30, count = 1 << 30;
  inline void step() {
    if (--count) return;
    count = every;
    if (p < end) {
      _mm_prefetch(p, _MM_HINT_T1);
      p += 64;
    }
  }
};

// The MR x NR tile's vector sums over k in [k0, k1) (multiples of 8), added to `part`
// (MR * NR * 8 floats) unless `first`; x and w rows are K elements apart.
template <int R, int C, typename W>
inline void tile(const float* x, const W* w, float* part, int64_t K, int64_t k0, int64_t k1,
                 bool first, Prefetch& pf) {
  __m256 acc[R][C];
  for (int m = 0; m < R; ++m)
    for (int n = 0; n < C; ++n)
      acc[m][n] = first ? _mm256_setzero_ps() : _mm256_load_ps(part + (m * C + n) * 8);
  for (int64_t k = k0; k < k1; k += 8) {
    pf.step();
    __m256 xv[R];
    for (int m = 0; m < R; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int n = 0; n < C; ++n) {
      const __m256 wv = load8(w + n * K + k);
      for (int m = 0; m < R; ++m) acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int n = 0; n < C; ++n) _mm256_store_ps(part + (m * C + n) * 8, acc[m][n]);
}

template <int C, typename W>
inline void tile_rows(int rows, const float* x, const W* w, float* part, int64_t K, int64_t k0,
                      int64_t k1, bool first, Prefetch& pf) {
  switch (rows) {
    case 3: tile<3, C>(x, w, part, K, k0, k1, first, pf); break;
    case 2: tile<2, C>(x, w, part, K, k0, k1, first, pf); break;
    default: tile<1, C>(x, w, part, K, k0, k1, first, pf); break;
  }
}

// y[:, n0:n0+C] for M <= M_GROUP rows of x against the C weight rows at w (scale: theirs).
template <int C, typename W>
void column_block(const float* x, int64_t M, const W* w, const uint16_t* scale, float* y, int64_t K,
                  int64_t N, Prefetch& pf) {
  alignas(32) float part[M_GROUP * C * 8];
  const int64_t K8 = K & ~int64_t{7};
  // x chunk (M x kc floats) + weight chunk (C x kc) within half of a 32 KiB L1
  const int64_t kc = std::max<int64_t>(64, std::min<int64_t>(512, (4096 / M) & ~int64_t{7}));
  for (int64_t k0 = 0; k0 < K8; k0 += kc) {
    const int64_t k1 = std::min(K8, k0 + kc);
    for (int64_t m = 0; m < M; m += MR)
      tile_rows<C>(static_cast<int>(std::min<int64_t>(MR, M - m)), x + m * K, w, part + m * C * 8, K,
                   k0, k1, k0 == 0, pf);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int n = 0; n < C; ++n)
      y[m * N + n] = finish(K8 ? _mm256_load_ps(part + (m * C + n) * 8) : _mm256_setzero_ps(),
                            x + m * K, w + n * K, K8, K, scale ? scale + n : nullptr);
}

// Blocks [b0, b1) of 4 weight rows each, all M rows of x.
template <typename W>
void run_blocks(const float* x, const W* w, const uint16_t* scale, float* y, int64_t M, int64_t N,
                int64_t K, int64_t b0, int64_t b1) {
  const int64_t steps_per_block = ((std::min(M, M_GROUP) + MR - 1) / MR) * (K / 8);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NR, nb = std::min<int64_t>(NR, N - n0);
    Prefetch pf;
    if (b + PF_AHEAD < b1) {   // the block PF_AHEAD ahead, spread over this block's k-steps
      const int64_t bytes = std::min<int64_t>(NR, N - (n0 + PF_AHEAD * NR)) * K * int64_t{sizeof(W)};
      pf.p = reinterpret_cast<const char*>(w + (n0 + PF_AHEAD * NR) * K);
      pf.end = pf.p + bytes;
      pf.every = pf.count = static_cast<int>(std::max<int64_t>(1, steps_per_block / ((bytes + 63) / 64)));
    }
    for (int64_t m = 0; m < M; m += M_GROUP) {
      const int64_t rows = std::min(M_GROUP, M - m);
      const float* xm = x + m * K;
      float* ym = y + m * N + n0;
      const W* wb = w + n0 * K;
      const uint16_t* sb = scale ? scale + n0 : nullptr;
      switch (nb) {
        case 4: column_block<4>(xm, rows, wb, sb, ym, K, N, pf); break;
        case 3: column_block<3>(xm, rows, wb, sb, ym, K, N, pf); break;
        case 2: column_block<2>(xm, rows, wb, sb, ym, K, N, pf); break;
        default: column_block<1>(xm, rows, wb, sb, ym, K, N, pf); break;
      }
    }
  }
}

// ---- one row of x (GEMV)
constexpr int GEMV_ROWS = 4;
// Per thread at least this many weight bytes: below it one thread streams the matrix sooner
// than a fork/join (a few microseconds, more when the other core is busy) pays back.
constexpr int64_t GEMV_MIN_BYTES = 256 << 10;
// L2 prefetch this far ahead in the thread's run: a tile's R lines per line step, spread over
// its k-steps (measured on one thread: float32 +3%; bf16 +15%, whose work per line leaves the
// out-of-order window fewer lines in flight).
constexpr int64_t GEMV_PREFETCH = 16 << 10;
// Weight bytes a thread takes at a time in a parallel GEMV
constexpr int64_t GEMV_CHUNK_BYTES = 512 << 10;

// y[n] for R weight rows at w: one vector sum per row, the same per-lane order as the tile.
// end: the end of the thread's run (no prefetch past it).
// An output as stored: float32, or bf16 rounded to nearest even as torch's CPU float -> bf16
// cast (its vectorized form writes any NaN as 0xffff)
inline void put(float* y, float v) { *y = v; }
inline void put(uint16_t* y, float v) { *y = to_bf16(v); }

template <int R, typename W, typename Y>
inline void gemv_tile(const float* x, const W* w, const uint16_t* scale, Y* y, int64_t K,
                      const char* end) {
  constexpr int STEPS = 64 / (8 * sizeof(W));          // k-steps of 8 per 64-byte line of a row
  constexpr int PER = R >= STEPS ? R / STEPS : 1, EVERY = R >= STEPS ? 1 : STEPS / R;
  const int64_t K8 = K & ~int64_t{7};
  const char* pf = reinterpret_cast<const char*>(w) + GEMV_PREFETCH;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * STEPS <= K8; k += 8 * STEPS) {
    for (int s = 0; s < STEPS; ++s) {
      if (s % EVERY == 0)
        for (int i = 0; i < PER; ++i, pf += 64)
          if (pf < end) _mm_prefetch(pf, _MM_HINT_T1);
      const int64_t j = k + 8 * s;
      const __m256 xv = _mm256_loadu_ps(x + j);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(xv, load8(w + r * K + j), acc[r]);
    }
  }
  for (; k < K8; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(xv, load8(w + r * K + k), acc[r]);
  }
  for (int r = 0; r < R; ++r) put(y + r, finish(acc[r], x, w + r * K, K8, K, scale ? scale + r : nullptr));
}

template <typename W, typename Y>
void gemv_rows(const float* x, const W* w, const uint16_t* scale, Y* y, int64_t K, int64_t n0,
               int64_t n1, int64_t N) {
  const char* end = reinterpret_cast<const char*>(w + N * K);   // prefetch runs on into the next rows
  int64_t n = n0;
  for (; n + GEMV_ROWS <= n1; n += GEMV_ROWS)
    gemv_tile<GEMV_ROWS>(x, w + n * K, scale ? scale + n : nullptr, y + n, K, end);
  for (; n < n1; ++n) gemv_tile<1>(x, w + n * K, scale ? scale + n : nullptr, y + n, K, end);
}

template <typename W, typename Y>
void gemv(const float* x, const W* w, const uint16_t* scale, Y* y, int64_t N, int64_t K,
          int num_threads) {
#ifdef FLASHRT_OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();
  const int64_t by_bytes = N * K * int64_t{sizeof(W)} / GEMV_MIN_BYTES;
  num_threads = static_cast<int>(std::min<int64_t>({num_threads, by_bytes, (N + 15) / 16}));
  if (num_threads > 1 && !forked_after_load()) {
    // balanced runs of rows, split at the multiple of 16 rows nearest an equal share (64
    // bytes of y: no line written by two threads)
    // runs of rows handed out in turn (multiples of 16 rows: no line of y written by two
    // threads), so a thread slowed by another process does not hold the call back
    const int64_t chunk = std::max<int64_t>(16, GEMV_CHUNK_BYTES / (K * int64_t{sizeof(W)}) / 16 * 16);
    const int64_t chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; ++c)
      gemv_rows(x, w, scale, y, K, c * chunk, std::min(N, (c + 1) * chunk), N);
    return;
  }
#else
  (void)num_threads;
#endif
  gemv_rows(x, w, scale, y, K, 0, N, N);
}

template <typename W>
void small_m(const float* x, const W* w, const uint16_t* scale, float* y, int64_t M, int64_t N,
             int64_t K, int num_threads) {
  if (M == 1) return gemv(x, w, scale, y, N, K, num_threads);
  const int64_t blocks = (N + NR - 1) / NR;
#ifdef FLASHRT_OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();   // torch.set_num_threads sets it
  num_threads = static_cast<int>(std::min<int64_t>(num_threads, blocks));
  if (num_threads > 1 && !forked_after_load()) {   // a forked child runs serially
    // one contiguous run of blocks per thread, so each can prefetch ahead within its own run
#pragma omp parallel num_threads(num_threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      run_blocks(x, w, scale, y, M, N, K, blocks * t / nt, blocks * (t + 1) / nt);
    }
    return;
  }
#else
  (void)num_threads;
#endif
  run_blocks(x, w, scale, y, M, N, K, 0, blocks);
}

}  // namespace

void small_m_linear(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                    int num_threads) {
  small_m(x, w, nullptr, y, M, N, K, num_threads);
}

void small_m_linear_bf16w(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N,
                          int64_t K, int num_threads) {
  small_m(x, w, nullptr, y, M, N, K, num_threads);
}

void gemv_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t N, int64_t K, int num_threads) {
  std::vector<float> xf(static_cast<size_t>(K));   // bf16 -> float32 is exact
  for (int64_t k = 0; k < K; ++k) xf[k] = widen(x[k]);
  gemv(xf.data(), w, nullptr, y, N, K, num_threads);
}

void small_m_linear_int8w(const float* x, const int8_t* w, const uint16_t* scale, float* y,
                          int64_t M, int64_t N, int64_t K, int num_threads) {
  small_m(x, w, scale, y, M, N, K, num_threads);
}

}  // namespace flashrt
