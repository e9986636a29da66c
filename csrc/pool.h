// The host thread pool behind the parallel kernels (block hashing, and the
// segmented copy in a build without OpenMP or after fork()): parked threads
// that take parts of one job at a time.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace flashrt {

// Hardware threads, read once per process: hardware_concurrency() reads /sys
// on Linux (~8 us, as much as a 100 KiB copy).
inline int host_cores() {
  static const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return cores;
}

// The caller takes parts too, so a job finishes even when no worker wakes
// (or none exists, as in a child after fork()). One job at a time:
// concurrent callers queue on `job_mu_`. Parts must not throw.
class WorkPool {
 public:
  // Never destroyed: joining parked threads during static destruction at
  // interpreter exit buys nothing and can hang.
  static WorkPool& instance() {
    static WorkPool* pool = [] {
      auto* p = new WorkPool();
      pthread_atfork(nullptr, nullptr, [] { instance().forget_workers(); });
      return p;
    }();
    return *pool;
  }

  // Runs part(t) for t in [0, parts) on up to `threads` threads, the caller included (parts
  // are handed out one at a time, so a slow thread holds up at most one); returns when all
  // are done. threads <= 0: one thread per part.
  template <typename F>
  void run(int64_t parts, const F& part, int64_t threads = 0) {
    std::lock_guard<std::mutex> job(job_mu_);
    ensure_workers((threads > 0 ? std::min(threads, parts) : parts) - 1);
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
    if (pending_.load() != 0) {  // a worker is still running: it is running, so spin first
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

}  // namespace flashrt
