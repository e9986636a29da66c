// AVX2 + FMA helpers shared by the kernels built with -mavx2 -mfma (include only from those).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace flashrt {

// exp of 8 floats: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial),
// within ~1 ulp of the exact value; inputs clamped to [-87.34, 88.72] (NaN stays NaN).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.7228f), _mm256_max_ps(_mm256_set1_ps(-87.3365f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// the 8 lanes' sum in a fixed tree: b_i = l_i + l_(i+4), then (b0 + b2) + (b1 + b3)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// silu(x) = x / (1 + exp(-x)), the form torch's CPU kernel computes
inline __m256 silu8(__m256 x) {
  const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), x);
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(neg)));
}

// 8 floats rounded to bf16 and widened back (round to nearest even, as torch's CPU cast; a NaN
// becomes all ones, which torch's vectorized cast stores as 0xffff)
inline __m256 round_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(r, high));
  return _mm256_or_ps(rounded, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

inline __m256 load8_bf16(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// 8 floats already rounded to bf16 (round_bf16_8), stored as bf16: their upper halves
inline void store8_bf16(uint16_t* p, __m256 v) {
  const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

}  // namespace flashrt
