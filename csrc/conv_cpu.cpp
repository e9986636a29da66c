// Depthwise causal conv + silu over a step's rows (flashrt.h's CausalConvArgs): nn.linear_attn's
// causal_conv torch form in one call. Per channel c the window is [state[c] (K-1), x[:, c] (T)];
//   out[t, c] = silu(sum_j window[t + j] w[c, j]), the sum from j = 0 up, each product rounded
// then added (the torch form's mul and addcmul_; built with -ffp-contract=off); a bf16 model
// rounds to bf16 after each, as its ops do. The state becomes the window's last K-1 inputs;
// planes[t] the state after row t. silu: 8 channels at a time (vec_avx2.h's exp, ~1 ulp).
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

template <typename T>
void run(const CausalConvArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  T* state = static_cast<T*>(a.state);
  T* planes = static_cast<T*>(a.planes);
  T* y = static_cast<T*>(a.y);
  const int64_t C = a.C, K = a.K, T_ = a.T, S = K - 1;
  std::vector<float> win(static_cast<size_t>(S + T_)), conv(static_cast<size_t>(T_ * C));
  for (int64_t c = 0; c < C; ++c) {
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
  const int64_t n = T_ * C;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) put8(y + i, silu8(_mm256_loadu_ps(conv.data() + i)));
  for (; i < n; ++i) put(y + i, conv[i] / (1.0f + std::exp(-conv[i])));
}

}  // namespace

void causal_conv_cpu(const CausalConvArgs& a) {
  if (a.bf16) return run<uint16_t>(a);
  run<float>(a);
}

}  // namespace flashrt
