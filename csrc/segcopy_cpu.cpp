// Host segmented copy. Runtime state moves (KV blocks, slot swaps) arrive as
// many small segments or a few huge ones; one memcpy loop is optimal for the
// former, while the latter needs several cores to approach memory bandwidth.
#include "flashrt.h"
#include "pool.h"
#include "segments.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace flashrt {
namespace {

// Parallel copies run on a pool of parked threads: spawning a thread costs
// tens of microseconds, as much as copying a few hundred KiB. Below
// kParallelMinBytes the calling thread alone is faster; above it each thread
// gets at least kMinBytesPerThread.
// (2 MiB / 1 MiB measured on a 2-core EPYC: below, the wake-up of a parked
// thread costs more than it saves.)
constexpr int64_t kParallelMinBytes = 512 << 10;
constexpr int64_t kMinBytesPerThread = 256 << 10;

// Copies stream byte range [lo, hi) of the concatenated segments.
void copy_range(const int64_t* src, const int64_t* dst, const std::vector<int64_t>& start,
                int64_t lo, int64_t hi) {
  for_each_piece(start, lo, hi, [&](size_t i, int64_t off, int64_t len) {
    std::memcpy(reinterpret_cast<char*>(dst[i]) + off, reinterpret_cast<const char*>(src[i]) + off,
                static_cast<size_t>(len));
  });
}

}  // namespace

void segcopy_cpu(const int64_t* src, const int64_t* dst, const int64_t* nbytes,
                 int64_t n, int num_threads) {
  const std::vector<int64_t> start = segment_starts(nbytes, n);
  const int64_t total = start[n];

  if (num_threads <= 0) num_threads = host_cores();
  int64_t threads = 1;
  if (total > kParallelMinBytes)
    threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, total / kMinBytesPerThread));
  if (threads == 1) {
    copy_range(src, dst, start, 0, total);
    return;
  }

  // Even byte split; boundaries rounded to 64 B so threads never share a
  // destination cache line when segments are cache-line aligned.
  auto bound = [&](int64_t t) {
    if (t == threads) return total;
    return (total / threads * t + std::min(t, total % threads)) & ~int64_t{63};
  };
  WorkPool::instance().run(threads, [&](int64_t t) {
    copy_range(src, dst, start, bound(t), bound(t + 1));
  });
}

}  // namespace flashrt
