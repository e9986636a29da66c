// One query's attention over a KV cache (a decode step), float32 math over float32 or bf16
// K/V rows: per query head, scores = scale * q K^T over L rows, softmax, p V. torch's CPU SDPA
// runs one query at a fraction of memory speed, and in bf16 wants K/V widened to float32 first
// (a copy of the cache every step); here each row is read in place and widened in registers.
// Threads split the query heads, G at a time sharing each K/V row read (each output a fixed order
// of sums): results do not depend on the thread count.
// Built with -mavx2 -mfma; the launcher checks the CPU first.
#include "flashrt.h"
#include "vec_avx2.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef FLASHRT_OPENMP
#include <omp.h>
#endif

namespace flashrt {
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return load8_bf16(p); }
// Rows ahead that the passes prefetch, into L2 (T1): an L1 prefetch holds one of the core's few
// line-fill buffers until its line arrives, which caps the misses in flight
constexpr int64_t PF_ROWS = 16;

// The G query heads h0.. that share kv head kvh: each K and V row is read once for all G
// (scores: G dot products a row; p V: row by row into the G outputs' sums, kept in L1). D a
// multiple of 8 (the launcher checks); s:
// G * (L + D) floats of scratch. K/V rows are strided (hkv heads a row): the passes prefetch ahead.
template <int G, typename T>
void group(const DecodeAttentionArgs& a, const T* k, const T* v, int64_t kvh, int64_t h0, float* s) {
  const int64_t D = a.d, L = a.L, stride = a.hkv * D;
  const float* q = a.q + h0 * D;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t l = 0; l < L; ++l) {          // scores: lane j of a head's sum takes d = j, j+8, ...
    const T* kr = k + l * stride + kvh * D;
    if (l + PF_ROWS < L) {
      const char* p = reinterpret_cast<const char*>(kr + PF_ROWS * stride);
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kv = load8(kr + d);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) s[g * L + l] = hsum(acc[g]) * a.scale;
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {              // softmax of each head's row: exp 8 at a time, sum in order
    float* sg = s + g * L;
    float mx = -INFINITY, sum = 0.f;
    for (int64_t l = 0; l < L; ++l) mx = std::max(mx, sg[l]);
    const __m256 m8 = _mm256_set1_ps(mx);
    int64_t l = 0;
    for (; l + 8 <= L; l += 8) _mm256_storeu_ps(sg + l, exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + l), m8)));
    for (; l < L; ++l) sg[l] = std::exp(sg[l] - mx);
    for (l = 0; l < L; ++l) sum += sg[l];
    inv[g] = 1.f / sum;
  }
  // o = sum over l in order of p_l V_l, row by row: each V row read once, whole and in order
  // (streams like K), the G x D sums in L1 scratch; per output the same FMAs in the same order
  float* o = s + G * L;
  for (int64_t i = 0; i < G * D; ++i) o[i] = 0.f;
  for (int64_t l = 0; l < L; ++l) {
    const T* vr = v + l * stride + kvh * D;
    if (l + PF_ROWS < L) {
      const char* p = reinterpret_cast<const char*>(vr + PF_ROWS * stride);
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
    __m256 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm256_set1_ps(s[g * L + l]);
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 vv = load8(vr + d);
      for (int g = 0; g < G; ++g)
        _mm256_storeu_ps(o + g * D + d, _mm256_fmadd_ps(p[g], vv, _mm256_loadu_ps(o + g * D + d)));
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 r = _mm256_set1_ps(inv[g]);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(a.out + (h0 + g) * D + d, _mm256_mul_ps(_mm256_loadu_ps(o + g * D + d), r));
  }
}

// Work item i of hq / G: a kv head and G of its query heads
template <int G, typename T>
void item(const DecodeAttentionArgs& a, const T* k, const T* v, int64_t i, float* s) {
  const int64_t per = (a.hq / a.hkv) / G, kvh = i / per;
  group<G>(a, k, v, kvh, kvh * (a.hq / a.hkv) + (i % per) * G, s);
}

template <int G, typename T>
void run(const DecodeAttentionArgs& a, int num_threads) {
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const int64_t items = a.hq / G;
#ifdef FLASHRT_OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();
  num_threads = static_cast<int>(std::min<int64_t>(num_threads, items));
  if (num_threads > 1 && !forked_after_load()) {
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<float> s(G * (a.L + a.d));
#pragma omp for schedule(static)
      for (int64_t i = 0; i < items; ++i) item<G>(a, k, v, i, s.data());
    }
    return;
  }
#else
  (void)num_threads;
#endif
  std::vector<float> s(G * (a.L + a.d));
  for (int64_t i = 0; i < items; ++i) item<G>(a, k, v, i, s.data());
}

// G: query heads a work item takes, a divisor of hq / hkv up to 4 (G accumulators in registers)
template <typename T>
void dispatch(const DecodeAttentionArgs& a, int num_threads) {
  const int64_t g = a.hq / a.hkv;
  if (g % 4 == 0) return run<4, T>(a, num_threads);
  if (g % 2 == 0) return run<2, T>(a, num_threads);
  run<1, T>(a, num_threads);
}

}  // namespace

void decode_attention_cpu(const DecodeAttentionArgs& a, int num_threads) {
  if (a.bf16_kv)
    dispatch<uint16_t>(a, num_threads);
  else
    dispatch<float>(a, num_threads);
}

}  // namespace flashrt
