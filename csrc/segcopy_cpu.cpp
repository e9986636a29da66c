// Host segmented copy. Runtime state moves (KV blocks, slot swaps) arrive as
// many small segments or a few huge ones; one memcpy loop is optimal for the
// former, while the latter needs several cores to approach memory bandwidth.
//
// Built with OpenMP, the parallel copy is one OpenMP region. Loaded after
// torch, the extension binds to the libgomp torch already loaded (same
// soname), so the copy runs on torch's own intra-op threads: right after a
// model step those threads spin on the cores, and a second pool of threads
// (WorkPool, the build without OpenMP) has to wait for them to yield
// (measured 2-3x slower than a torch copy at 4-16 MiB on 2 cores).
#include "flashrt.h"
#include "pool.h"
#include "segments.h"

#include <algorithm>
#include <cstring>
#include <vector>

#ifdef FLASHRT_OPENMP
#include <dlfcn.h>
#include <omp.h>
#include <pthread.h>

#include <atomic>
#endif

namespace flashrt {
namespace {

#ifdef FLASHRT_OPENMP
// libgomp keeps its thread pool across fork(): in the child those threads do not exist, and a
// parallel region can wait for them forever. A process forked after this module loaded copies
// on WorkPool instead, which starts its threads afresh in a child.
std::atomic<bool> forked{false};
const int fork_hook = pthread_atfork(nullptr, nullptr, [] { forked.store(true); });
#endif

// Parallel copies run on threads that already exist (OpenMP's or WorkPool's):
// spawning a thread costs tens of microseconds, as much as copying a few
// hundred KiB. Below kParallelMinBytes the calling thread alone is faster;
// above it each thread gets at least kMinBytesPerThread.
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

#ifdef FLASHRT_OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();   // torch.set_num_threads sets it
#else
  if (num_threads <= 0) num_threads = host_cores();
#endif
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
#ifdef FLASHRT_OPENMP
  if (!forked.load(std::memory_order_relaxed)) {
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1)
    for (int64_t t = 0; t < threads; ++t) copy_range(src, dst, start, bound(t), bound(t + 1));
    return;
  }
#endif
  WorkPool::instance().run(threads, [&](int64_t t) {
    copy_range(src, dst, start, bound(t), bound(t + 1));
  });
}

bool forked_after_load() {
#ifdef FLASHRT_OPENMP
  return forked.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

const char* openmp_runtime() {
#ifdef FLASHRT_OPENMP
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&omp_get_max_threads), &info) != 0 && info.dli_fname != nullptr)
    return info.dli_fname;
  return "?";
#else
  return "";
#endif
}

}  // namespace flashrt
