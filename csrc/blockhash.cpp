// Block checksums (XXH3-64 per block) of a capsule's byte stream, computed
// while saving and verified while loading. Independent fixed-size blocks (not
// one digest chained over the whole stream) let every core hash its own
// share, and a reader hashes each block right after reading it, while it is
// in cache: reading everything and then hashing walks the bytes through DRAM
// twice.
#include "flashrt.h"
#include "pool.h"
#include "segments.h"

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <system_error>
#include <vector>

namespace flashrt {
namespace {

// Below these the calling thread alone is faster: waking a parked worker
// costs tens of microseconds, as long as XXH3 takes for ~1 MiB, and more when
// the worker's core is cold; a load is rarely back to back with the last one.
// Measured with caches evicted between calls on a 2-core EPYC, read+hash on
// one / two threads: 4 MiB 1.13 / 1.16 ms, 8 MiB 2.06 / 2.18, 16 MiB 3.81 /
// 2.59 (a plain read: 0.90, 1.57, 2.97).
constexpr int64_t kHashParallelMinBytes = 2 << 20;
constexpr int64_t kReadParallelMinBytes = 12 << 20;

// The stream as segments: their addresses and where each starts in the stream.
struct Stream {
  const int64_t* addr;
  std::vector<int64_t> start;

  Stream(const int64_t* a, const int64_t* nbytes, int64_t n) : addr(a), start(segment_starts(nbytes, n)) {}
  int64_t total() const { return start.back(); }

  // The pieces of segments that hold stream bytes [lo, hi).
  void pieces(int64_t lo, int64_t hi, std::vector<ByteSpan>* out) const {
    out->clear();
    for_each_piece(start, lo, hi, [&](size_t i, int64_t off, int64_t len) {
      out->push_back({reinterpret_cast<const char*>(addr[i]) + off, static_cast<std::size_t>(len)});
    });
  }
};

// Fills the pieces from fd at `offset`; false when the file ends first. The
// pieces are read-only spans for hashing; here they are the caller's
// destination buffers, hence the const_cast.
bool pread_pieces(int fd, int64_t offset, const std::vector<ByteSpan>& ps) {
  std::vector<iovec> iov;
  iov.reserve(ps.size());
  for (const ByteSpan& p : ps) iov.push_back({const_cast<void*>(p.data), p.len});
  size_t k = 0;
  while (k < iov.size()) {
    const int cnt = static_cast<int>(std::min<size_t>(iov.size() - k, IOV_MAX));
    const ssize_t n = ::preadv(fd, iov.data() + k, cnt, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::system_error(errno, std::generic_category(), "preadv");
    }
    if (n == 0) return false;
    offset += n;
    for (std::size_t left = static_cast<std::size_t>(n); left > 0;) {  // skip what was filled
      const std::size_t take = std::min(left, iov[k].iov_len);
      iov[k].iov_base = static_cast<char*>(iov[k].iov_base) + take;
      iov[k].iov_len -= take;
      left -= take;
      if (iov[k].iov_len == 0) ++k;
    }
    while (k < iov.size() && iov[k].iov_len == 0) ++k;
  }
  return true;
}

// Runs fn(b, scratch) for every block: on the calling thread for small streams,
// otherwise over the pool one block at a time, so a thread that wakes late or
// loses its core to another process's spinning threads holds up one block,
// not a fixed share. fn must not throw.
template <typename F>
void for_blocks(int64_t total, int64_t block, int num_threads, int64_t min_parallel, const F& fn) {
  const int64_t nblocks = (total + block - 1) / block;
  if (num_threads <= 0) num_threads = host_cores();
  if (total < min_parallel || num_threads == 1 || nblocks < 2) {
    std::vector<ByteSpan> scratch;
    for (int64_t b = 0; b < nblocks; ++b) fn(b, &scratch);
    return;
  }
  WorkPool::instance().run(nblocks, [&](int64_t b) {
    thread_local std::vector<ByteSpan> scratch;
    fn(b, &scratch);
  }, num_threads);
}

}  // namespace

void hash_blocks(const int64_t* addr, const int64_t* nbytes, int64_t n, int64_t block,
                 uint64_t* digests, int num_threads) {
  const Stream s(addr, nbytes, n);
  const int64_t total = s.total();
  for_blocks(total, block, num_threads, kHashParallelMinBytes, [&](int64_t b, std::vector<ByteSpan>* ps) {
    s.pieces(b * block, std::min(total, (b + 1) * block), ps);
    digests[b] = xxh3_64(ps->data(), ps->size());
  });
}

bool read_blocks_hashed(int fd, int64_t offset, const int64_t* addr, const int64_t* nbytes,
                        int64_t n, int64_t block, uint64_t* digests, int num_threads) {
  const Stream s(addr, nbytes, n);
  const int64_t total = s.total();
  std::atomic<int> err{0};
  std::atomic<bool> short_read{false};
  for_blocks(total, block, num_threads, kReadParallelMinBytes, [&](int64_t b, std::vector<ByteSpan>* ps) {
    if (err.load(std::memory_order_relaxed) || short_read.load(std::memory_order_relaxed)) return;
    const int64_t lo = b * block;
    s.pieces(lo, std::min(total, lo + block), ps);
    try {
      if (!pread_pieces(fd, offset + lo, *ps)) {
        short_read = true;
        return;
      }
    } catch (const std::system_error& e) {
      err = e.code().value();
      return;
    }
    digests[b] = xxh3_64(ps->data(), ps->size());
  });
  if (err.load()) throw std::system_error(err.load(), std::generic_category(), "preadv");
  return !short_read.load();
}

}  // namespace flashrt
