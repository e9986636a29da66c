// XXH3-64 with AVX2 code; built only for x86-64 and called only on CPUs that
// report AVX2 (see xxhash.cpp).
#define FLASHRT_XXH3_BODY xxh3_64_avx2_body
#include "xxh3_body.h"

namespace flashrt {
namespace detail {
uint64_t xxh3_64_avx2(const ByteSpan* spans, std::size_t n) { return xxh3_64_avx2_body(spans, n); }
}  // namespace detail
}  // namespace flashrt
