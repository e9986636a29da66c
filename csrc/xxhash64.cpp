// XXH64, written from the public spec so flashrt has no third-party C
// dependency; checksums must equal those of the reference library (and of
// flashrt.native._xxh64_py) because they are compared across installs.
#include "flashrt.h"

#include <cstring>

namespace flashrt {
namespace {

constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t P2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t P3 = 0x165667B19E3779F9ULL;
constexpr uint64_t P4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t P5 = 0x27D4EB2F165667C5ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// The spec reads input as little-endian words; memcpy keeps unaligned
// reads legal and compiles to a single load.
inline uint64_t read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}
inline uint64_t read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap32(v);
#endif
  return v;
}

inline uint64_t lane_round(uint64_t acc, uint64_t input) {
  acc += input * P2;
  return rotl(acc, 31) * P1;
}
inline uint64_t merge(uint64_t acc, uint64_t lane) {
  acc ^= lane_round(0, lane);
  return acc * P1 + P4;
}

}  // namespace

// Streaming form: the same digest over the concatenated input, whatever the
// split, so a reader can hash each chunk while it is still in cache. The
// four lanes of a 32-byte stripe are independent: the CPU pipelines them,
// which is where the algorithm's speed comes from.
Xxh64Stream::Xxh64Stream(uint64_t seed)
    : v1_(seed + P1 + P2), v2_(seed + P2), v3_(seed), v4_(seed - P1), seed_(seed) {}

void Xxh64Stream::update(const void* data, std::size_t len) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + len;
  total_ += len;
  if (buffered_ + len < 32) {
    std::memcpy(buf_ + buffered_, p, len);
    buffered_ += len;
    return;
  }
  if (buffered_) {  // complete the pending stripe
    const std::size_t fill = 32 - buffered_;
    std::memcpy(buf_ + buffered_, p, fill);
    p += fill;
    v1_ = lane_round(v1_, read64(buf_));
    v2_ = lane_round(v2_, read64(buf_ + 8));
    v3_ = lane_round(v3_, read64(buf_ + 16));
    v4_ = lane_round(v4_, read64(buf_ + 24));
    buffered_ = 0;
  }
  // locals: the input may alias *this as far as the compiler knows, which would keep the
  // lanes in memory instead of registers
  uint64_t v1 = v1_, v2 = v2_, v3 = v3_, v4 = v4_;
  for (; end - p >= 32; p += 32) {
    v1 = lane_round(v1, read64(p));
    v2 = lane_round(v2, read64(p + 8));
    v3 = lane_round(v3, read64(p + 16));
    v4 = lane_round(v4, read64(p + 24));
  }
  v1_ = v1, v2_ = v2, v3_ = v3, v4_ = v4;
  buffered_ = static_cast<std::size_t>(end - p);
  std::memcpy(buf_, p, buffered_);
}

uint64_t Xxh64Stream::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v1_, 1) + rotl(v2_, 7) + rotl(v3_, 12) + rotl(v4_, 18);
    h = merge(merge(merge(merge(h, v1_), v2_), v3_), v4_);
  } else {
    h = seed_ + P5;
  }
  h += total_;
  const unsigned char* p = buf_;
  const unsigned char* const end = buf_ + buffered_;
  for (; end - p >= 8; p += 8) h = rotl(h ^ lane_round(0, read64(p)), 27) * P1 + P4;
  if (end - p >= 4) {
    h = rotl(h ^ (read32(p) * P1), 23) * P2 + P3;
    p += 4;
  }
  for (; p < end; ++p) h = rotl(h ^ (*p * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, std::size_t len, uint64_t seed) {
  Xxh64Stream h(seed);
  h.update(data, len);
  return h.digest();
}

}  // namespace flashrt
