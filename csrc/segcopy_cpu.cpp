// Host segmented copy. Runtime state moves (KV blocks, slot swaps) arrive as
// many small segments or a few huge ones; one memcpy loop is optimal for the
// former, while the latter needs several cores to approach memory bandwidth.
#include "flashrt.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
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

// Copies global byte range [lo, hi) of the concatenated segments. `start` is
// the exclusive prefix sum of segment sizes (n + 1 entries).
void copy_range(const int64_t* src, const int64_t* dst, const std::vector<int64_t>& start,
                int64_t lo, int64_t hi) {
  if (lo >= hi) return;
  // Last segment starting at or before lo; empty segments share a start with
  // their successor, so upper_bound skips them.
  size_t i = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
  for (int64_t pos = lo; pos < hi; ++i) {
    const int64_t off = pos - start[i];
    const int64_t len = std::min(start[i + 1], hi) - pos;
    if (len > 0)
      std::memcpy(reinterpret_cast<char*>(dst[i]) + off,
                  reinterpret_cast<const char*>(src[i]) + off, static_cast<size_t>(len));
    pos += len;
  }
}

// Parked worker threads that take parts of one job at a time. The caller
// takes parts too, so a job finishes even when no worker wakes (or none
// exists, as in a child after fork()). One job at a time: concurrent callers
// queue on `job_mu_`.
class CopyPool {
 public:
  // Never destroyed: joining parked threads during static destruction at
  // interpreter exit buys nothing and can hang.
  static CopyPool& instance() {
    static CopyPool* pool = [] {
      auto* p = new CopyPool();
      pthread_atfork(nullptr, nullptr, [] { instance().forget_workers(); });
      return p;
    }();
    return *pool;
  }

  // Runs part(t) for t in [0, parts), the caller included; returns when all are done.
  template <typename F>
  void run(int64_t parts, const F& part) {
    std::lock_guard<std::mutex> job(job_mu_);
    ensure_workers(parts - 1);
    const std::function<void(int64_t)> fn = part;
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      parts_ = parts;
      next_ = 0;
      pending_ = parts;
      ++generation_;
    }
    cv_.notify_all();
    std::unique_lock<std::mutex> lk(mu_);
    take_parts(lk);
    if (pending_.load() != 0) {  // a worker is still copying: it is running, so spin first
      lk.unlock();
      spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
      lk.lock();
    }
    done_cv_.wait(lk, [&] { return pending_.load() == 0; });
    fn_ = nullptr;
  }

 private:
  void ensure_workers(int64_t want) {
    while (static_cast<int64_t>(workers_.size()) < want) {
      try {
        workers_.emplace_back([this] { loop(); });
      } catch (const std::system_error&) {
        return;  // out of threads: the caller does the remaining parts
      }
    }
  }

  // In a fork() child only the forking thread exists; the handles are dropped
  // without join (the threads are not there to join) and new ones start on demand.
  void forget_workers() {
    new (&mu_) std::mutex();
    new (&job_mu_) std::mutex();
    new (&cv_) std::condition_variable();
    new (&done_cv_) std::condition_variable();
    for (auto& t : workers_) new (&t) std::thread();  // not joinable: safe to destroy
    workers_.clear();
  }

  // Called with mu_ held; runs parts until none is left.
  void take_parts(std::unique_lock<std::mutex>& lk) {
    while (fn_ != nullptr && next_ < parts_) {
      const int64_t t = next_++;
      const auto* fn = fn_;
      lk.unlock();
      (*fn)(t);
      lk.lock();
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  // Spins up to kSpin for `done`: on a VM, waking a parked thread whose vCPU went idle costs
  // an inter-processor interrupt, tens to hundreds of microseconds; torch's OpenMP workers
  // spin after a parallel region for the same reason. Capsule copies come in bursts.
  template <typename Done>
  static void spin_until(const Done& done) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 1; !done(); ++i) {
      if ((i & 63) == 0 && std::chrono::steady_clock::now() > until) return;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return generation_.load() != seen; });
      seen = generation_.load();
      take_parts(lk);
    }
  }

  std::mutex job_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t parts_ = 0, next_ = 0;
  std::atomic<int64_t> pending_{0};     // changed under mu_; also read spinning, without it
  std::atomic<uint64_t> generation_{0};
  static constexpr std::chrono::microseconds kSpin{200};
};

}  // namespace

void segcopy_cpu(const int64_t* src, const int64_t* dst, const int64_t* nbytes,
                 int64_t n, int num_threads) {
  std::vector<int64_t> start(static_cast<size_t>(n) + 1, 0);
  for (int64_t i = 0; i < n; ++i) start[i + 1] = start[i] + nbytes[i];
  const int64_t total = start[n];

  // hardware_concurrency() reads /sys on Linux (~8 us): once per process.
  static const int kCores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (num_threads <= 0) num_threads = kCores;
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
  CopyPool::instance().run(threads, [&](int64_t t) {
    copy_range(src, dst, start, bound(t), bound(t + 1));
  });
}

}  // namespace flashrt
