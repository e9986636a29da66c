// Depthwise causal conv + silu over a step's rows (flashrt.h's CausalConvArgs): nn.linear_attn's
// causal_conv torch form in one call. Per channel c the window is [state[c] (K-1), x[:, c] (T)];
//   out[t, c] = silu(sum_j window[t + j] w[c, j]), the sum from j = 0 up, each product rounded
// then added (the torch form's mul and addcmul_; built with -ffp-contract=off); a bf16 model
// rounds to bf16 after each, as its ops do. The state becomes the window's last K-1 inputs;
// planes[t] the state after row t. silu: 8 channels at a time (vec_avx2.h's exp, ~1 ulp).
// A decode step's row (K = 4) takes 8 channels at a time, the same operations in each lane.
// Built with -mavx2 -mfma; the launcher checks the CPU.
#include "bf16.h"
#include "flashrt.h"
#include "vec_avx2.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace flashrt {
namespace {

// a value as the model's dtype holds it
inline float held(float v, const float*) { return v; }
inline float held(float v, const uint16_t*) { return round_bf16(v); }
inline void put(float* y, float v) { *y = v; }
inline void put(uint16_t* y, float v) { *y = to_bf16(v); }
inline void put8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
inline void put8(uint16_t* y, __m256 v) { store8_bf16(y, round_bf16_8(v)); }

// 8 values at base[idx * stride]: float32 as stored, bf16 widened (a 32-bit gather at the
// value's address, its low half the value: each read ends 2 bytes past the value)
inline __m256 gather8(const float* base, __m256i idx) { return _mm256_i32gather_ps(base, idx, 4); }
inline __m256 gather8(const uint16_t* base, __m256i idx) {
  const __m256i v = _mm256_i32gather_epi32(reinterpret_cast<const int*>(base), idx, 2);
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return load8_bf16(p); }
inline __m256 held8(__m256 v, const float*) { return v; }
inline __m256 held8(__m256 v, const uint16_t*) { return round_bf16_8(v); }

// One row (a decode step) with K = 4 (Qwen3.5's): conv[c] for 8 channels at a time, their
// windows gathered across the (C, 3) state and (C, 4) weight rows, each product and add as
// the scalar loop's; the state shifted. Stops 8 short of C (no gather reads past the rows).
// Returns the channels done.
template <typename T>
int64_t one_row_k4(const T* x, const T* w, T* state, float* conv, int64_t C) {
  const __m256i s_idx = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
  const __m256i w_idx = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  int64_t c = 0;
  for (; c + 8 < C; c += 8) {
    const T* sc = state + c * 3;
    const T* wc = w + c * 4;
    const __m256 s0 = gather8(sc, s_idx), s1 = gather8(sc + 1, s_idx), s2 = gather8(sc + 2, s_idx);
    const __m256 xv = load8(x + c);
    __m256 o = held8(_mm256_mul_ps(s0, gather8(wc, w_idx)), w);
    o = held8(_mm256_add_ps(o, _mm256_mul_ps(s1, gather8(wc + 1, w_idx))), w);
    o = held8(_mm256_add_ps(o, _mm256_mul_ps(s2, gather8(wc + 2, w_idx))), w);
    o = held8(_mm256_add_ps(o, _mm256_mul_ps(xv, gather8(wc + 3, w_idx))), w);
    _mm256_storeu_ps(conv + c, o);
    T* st = state + c * 3;
    for (int i = 0; i < 8; ++i) {   // [s0, s1, s2] -> [s1, s2, x]
      st[3 * i] = st[3 * i + 1];
      st[3 * i + 1] = st[3 * i + 2];
      st[3 * i + 2] = x[c + i];
    }
  }
  return c;
}

template <typename T>
void run(const CausalConvArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  T* state = static_cast<T*>(a.state);
  T* planes = static_cast<T*>(a.planes);
  T* y = static_cast<T*>(a.y);
  const int64_t C = a.C, K = a.K, T_ = a.T, S = K - 1;
  std::vector<float> win(static_cast<size_t>(S + T_)), conv(static_cast<size_t>(T_ * C));
  const int64_t c0 = T_ == 1 && K == 4 && !planes ? one_row_k4(x, w, state, conv.data(), C) : 0;
  for (int64_t c = c0; c < C; ++c) {
    for (int64_t i = 0; i < S; ++i) win[i] = widen(state[c * S + i]);
    for (int64_t t = 0; t < T_; ++t) win[S + t] = widen(x[t * C + c]);
    const T* wc = w + c * K;
    for (int64_t t = 0; t < T_; ++t) {
      float o = held(win[t] * widen(wc[0]), w);
      for (int64_t j = 1; j < K; ++j) o = held(o + win[t + j] * widen(wc[j]), w);
      conv[t * C + c] = o;
      if (planes)
        for (int64_t i = 0; i < S; ++i) put(planes + (t * C + c) * S + i, win[t + 1 + i]);
    }
    for (int64_t i = 0; i < S; ++i) put(state + c * S + i, win[T_ + i]);
  }
  for (int64_t t = 0; t < T_; ++t) {    // row by row: a row's bits do not depend on T
    int64_t i = t * C;
    const int64_t end = i + C;
    for (; i + 8 <= end; i += 8) put8(y + i, silu8(_mm256_loadu_ps(conv.data() + i)));
    for (; i < end; ++i) put(y + i, conv[i] / (1.0f + std::exp(-conv[i])));
  }
}

}  // namespace

void causal_conv_cpu(const CausalConvArgs& a) {
  if (a.bf16) return run<uint16_t>(a);
  run<float>(a);
}

}  // namespace flashrt
