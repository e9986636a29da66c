// SwiGLU's silu(gate) * up over a step's rows (flashrt.h's SiluMulArgs): torch's two ops and
// their two outputs in one pass. float32: silu(g) u; bf16: silu(g) rounded to bf16, then the
// product rounded, as the two torch ops round. silu: vec_avx2.h's (exp within ~1 ulp).
// Built with -mavx2 -mfma; the launcher checks the CPU.
#include "flashrt.h"
#include "vec_avx2.h"

#include <cstdint>

namespace flashrt {
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return load8_bf16(p); }
inline __m256 held(__m256 v, const float*) { return v; }
inline __m256 held(__m256 v, const uint16_t*) { return round_bf16_8(v); }
inline void put8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
inline void put8(uint16_t* y, __m256 v) { store8_bf16(y, round_bf16_8(v)); }

// the last n < 8 values through a zero-padded vector (the same lanes' arithmetic)
template <typename T>
void tail(const T* g, const T* u, T* y, int64_t n) {
  alignas(32) T gb[8] = {}, ub[8] = {}, yb[8];
  for (int64_t i = 0; i < n; ++i) gb[i] = g[i], ub[i] = u[i];
  put8(yb, _mm256_mul_ps(held(silu8(load8(gb)), gb), load8(ub)));
  for (int64_t i = 0; i < n; ++i) y[i] = yb[i];
}

template <typename T>
void run(const SiluMulArgs& a) {
  const T* g = static_cast<const T*>(a.gate);
  const T* u = static_cast<const T*>(a.up);
  T* y = static_cast<T*>(a.y);
  for (int64_t m = 0; m < a.M; ++m) {
    const T *gm = g + m * a.gate_stride, *um = u + m * a.up_stride;
    T* ym = y + m * a.N;
    int64_t i = 0;
    for (; i + 8 <= a.N; i += 8) put8(ym + i, _mm256_mul_ps(held(silu8(load8(gm + i)), gm), load8(um + i)));
    if (i < a.N) tail(gm + i, um + i, ym + i, a.N - i);
  }
}

}  // namespace

void silu_mul_cpu(const SiluMulArgs& a) {
  if (a.bf16) return run<uint16_t>(a);
  run<float>(a);
}

}  // namespace flashrt
