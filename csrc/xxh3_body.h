// Body of one XXH3-64 entry point, included by xxhash.cpp (baseline ISA) and
// xxh3_avx2.cpp (compiled with -mavx2): xxhash.h picks its vector code from
// the compiler's target flags, so each file gets its own copy. XXH_INLINE_ALL
// gives every xxhash function internal linkage: the two copies never clash.
#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#include "flashrt.h"

static uint64_t FLASHRT_XXH3_BODY(const flashrt::ByteSpan* spans, std::size_t n) {
  if (n == 1) return XXH3_64bits(spans[0].data, spans[0].len);
  XXH3_state_t state;  // ~580 B: on the stack, no allocation
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  for (std::size_t i = 0; i < n; ++i) XXH3_64bits_update(&state, spans[i].data, spans[i].len);
  return XXH3_64bits_digest(&state);
}
