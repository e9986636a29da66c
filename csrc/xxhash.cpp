// XXH64 and XXH3-64 from the vendored reference xxhash.h, so digests equal
// every other implementation's (flashrt.native's Python fallbacks are tested
// against these). XXH3 gets AVX2 code at run time where the CPU has it: 2.7x
// the baseline SSE2 speed on 256 KiB blocks (EPYC, in cache).
#define FLASHRT_XXH3_BODY xxh3_64_baseline
#include "xxh3_body.h"

namespace flashrt {

#ifdef FLASHRT_XXH3_AVX2
namespace detail {
uint64_t xxh3_64_avx2(const ByteSpan* spans, std::size_t n);
}  // namespace detail
#endif

uint64_t xxh64(const void* data, std::size_t len, uint64_t seed) { return XXH64(data, len, seed); }

uint64_t xxh3_64(const ByteSpan* spans, std::size_t n) {
#ifdef FLASHRT_XXH3_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return detail::xxh3_64_avx2(spans, n);
#endif
  return xxh3_64_baseline(spans, n);
}

const char* xxh3_isa() {
#ifdef FLASHRT_XXH3_AVX2
  if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
  return "baseline";
}

}  // namespace flashrt
