// bf16 <-> float32 by bits, as torch's CPU casts do them; shared by the CPU kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace flashrt {

// bf16 (its bits) -> float32: exact
inline float widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float widen(float v) { return v; }

// float32 -> bf16, rounded to nearest even; any NaN as 0xffff (torch's vectorized cast)
inline uint16_t to_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0xffff}
                                        : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// float32 rounded to a bf16 value, kept as float32
inline float round_bf16(float v) { return widen(to_bf16(v)); }

}  // namespace flashrt
