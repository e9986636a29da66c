// One token at a time of Gated DeltaNet's rule (a decode step, or a speculative verify that
// keeps the state after each token), per value head h of T tokens, in float32:
//   q, k l2-normed (q also by Dk^-1/2); S (Dk, Dv) *= exp(g); delta = (v - k S) * beta;
//   S += k^T delta; o = q S.
// The torch form runs ~25 ops a token and layer and reads the 64 KiB state of a head four
// times; here each head's state is read and written in two passes while it sits in L2.
// Heads are independent: threads split them, so results do not depend on the thread count.
// Gated form (GdnArgs::gate): the decay and beta from the raw projections, and the output gated
// norm of Qwen3.5's block, in the same call (~30 fewer torch ops a layer and token).
// bf16_io: a bf16 model's qkv, a, b, z, norm weight and output as they are (no float32 copies).
// Built with -mavx2 -mfma (the loops over Dv vectorize); the launcher checks the CPU first.
#include "bf16.h"
#include "flashrt.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef FLASHRT_OPENMP
#include <omp.h>
#endif

namespace flashrt {
namespace {

// x (D,) / sqrt(sum x^2 + 1e-6), then times `extra`: the torch form's l2norm and q scale
template <typename T>
void l2norm(const T* x, float* out, int64_t D, float extra) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; ++i) ss += widen(x[i]) * widen(x[i]);
  const float r = 1.f / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < D; ++i) out[i] = (widen(x[i]) * r) * extra;
}

// an output value as stored: float32, or a value already rounded to bf16 (round_bf16) as bf16
// (its upper half; a NaN as 0xffff, torch's vectorized cast)
inline void put(float* y, float v) { *y = v; }
inline void put(uint16_t* y, float v) { *y = to_bf16(v); }

// softplus as torch's (beta 1, threshold 20)
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// o (Dv,) of head h, token t, in place: rmsnorm(o) * norm_w * silu(z) with the torch form's roundings
template <typename T>
void gate_output(const GdnArgs& a, const GdnGate& gt, int64_t t, int64_t h, float* o) {
  const int64_t Dv = a.dv;
  const auto rnd = [&](float v) { return gt.round_bf16 ? round_bf16(v) : v; };
  float ss = 0.f;
  for (int64_t j = 0; j < Dv; ++j) {
    o[j] = rnd(o[j]);
    ss += o[j] * o[j];
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(Dv) + gt.eps);
  const T* z = static_cast<const T*>(gt.z) + (t * a.hv + h) * Dv;
  const T* w = static_cast<const T*>(gt.norm_w);
  for (int64_t j = 0; j < Dv; ++j) {
    const float n = rnd(widen(w[j]) * rnd(o[j] * r)), zj = widen(z[j]);
    o[j] = rnd(n * (zj / (1.f + std::exp(-zj))));
  }
}

// T: the type of qkv, g, beta, z, norm_w and out (float, or bf16 as uint16_t under bf16_io)
template <typename T>
void head(const GdnArgs& a, int64_t h) {
  const int64_t Dk = a.dk, Dv = a.dv, kh = h / (a.hv / a.hk);
  float* S = a.state + h * Dk * Dv;
  float q[512], k[512], kv[512], o[512];   // Dk, Dv <= 512 (the launcher checks)
  const float qscale = 1.f / std::sqrt(static_cast<float>(Dk));
  const T* qkv = static_cast<const T*>(a.qkv);
  for (int64_t t = 0; t < a.T; ++t) {
    const T* row = qkv + t * a.qkv_stride;
    l2norm(row + a.q_off + kh * Dk, q, Dk, qscale);
    l2norm(row + a.k_off + kh * Dk, k, Dk, 1.f);
    const T* v = row + a.v_off + h * Dv;
    float g = widen(static_cast<const T*>(a.g)[t * a.hv + h]);
    float beta = widen(static_cast<const T*>(a.beta)[t * a.hv + h]);
    if (a.gate != nullptr) {                    // raw projections: the decay and beta of the form
      g = -std::exp(a.gate->a_log[h]) * softplus(g + a.gate->dt_bias[h]);
      beta = 1.f / (1.f + std::exp(-beta));
      if (a.gate->round_bf16) beta = round_bf16(beta);
    }
    const float decay = std::exp(g);
    for (int64_t j = 0; j < Dv; ++j) kv[j] = 0.f;
    for (int64_t i = 0; i < Dk; ++i) {           // S *= decay; kv = k S
      float* s = S + i * Dv;
      const float ki = k[i];
      for (int64_t j = 0; j < Dv; ++j) {
        s[j] *= decay;
        kv[j] += ki * s[j];
      }
    }
    for (int64_t j = 0; j < Dv; ++j) kv[j] = (widen(v[j]) - kv[j]) * beta;   // delta
    for (int64_t j = 0; j < Dv; ++j) o[j] = 0.f;
    for (int64_t i = 0; i < Dk; ++i) {           // S += k^T delta; o = q S
      float* s = S + i * Dv;
      const float ki = k[i], qi = q[i];
      for (int64_t j = 0; j < Dv; ++j) {
        s[j] += ki * kv[j];
        o[j] += qi * s[j];
      }
    }
    if (a.gate != nullptr) gate_output<T>(a, *a.gate, t, h, o);
    T* out = static_cast<T*>(a.out) + (t * a.hv + h) * Dv;
    for (int64_t j = 0; j < Dv; ++j) put(out + j, o[j]);
    if (a.planes != nullptr) {
      float* p = a.planes + (t * a.hv + h) * Dk * Dv;
      for (int64_t i = 0; i < Dk * Dv; ++i) p[i] = S[i];
    }
  }
}

inline void head_any(const GdnArgs& a, int64_t h) {
  if (a.bf16_io) return head<uint16_t>(a, h);
  head<float>(a, h);
}

}  // namespace

void gated_delta_rule_cpu(const GdnArgs& a, int num_threads) {
#ifdef FLASHRT_OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();
  num_threads = static_cast<int>(std::min<int64_t>(num_threads, a.hv));
  if (num_threads > 1 && !forked_after_load()) {
    // heads handed out in turn: a thread slowed by another process does not hold the call back
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t h = 0; h < a.hv; ++h) head_any(a, h);
    return;
  }
#else
  (void)num_threads;
#endif
  for (int64_t h = 0; h < a.hv; ++h) head_any(a, h);
}

}  // namespace flashrt
