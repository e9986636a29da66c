// Kernel layer of flashrt._C: plain C++ on raw pointers, no Python and no
// CUDA headers, so each kernel can be built (and reused) on its own.
// Segment tables are three parallel int64 arrays: src address, dst address,
// byte count. Addresses are integers because the Python side hands us
// torch data_ptr()s; the extension deliberately does not link libtorch.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashrt {

// Copies every segment on the host. Large volumes are split evenly by bytes
// (not by segment) over up to num_threads threads (0 = hardware concurrency).
// Segments must not overlap each other's destinations or their own source.
void segcopy_cpu(const int64_t* src, const int64_t* dst, const int64_t* nbytes,
                 int64_t n, int num_threads);

// Copies every segment with one kernel launch on `stream` (a cudaStream_t
// as an integer) for up to a few hundred segments; see segcopy_cuda.cu.
// Asynchronous with respect to the host, like cudaMemcpyAsync.
void segcopy_cuda(const int64_t* src, const int64_t* dst, const int64_t* nbytes,
                  int64_t n, std::uintptr_t stream);

// Standard XXH64 (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md).
uint64_t xxh64(const void* data, std::size_t len, uint64_t seed);

// XXH64 fed in pieces; digest() equals xxh64() of the pieces concatenated.
class Xxh64Stream {
 public:
  explicit Xxh64Stream(uint64_t seed);
  void update(const void* data, std::size_t len);
  uint64_t digest() const;

 private:
  uint64_t v1_, v2_, v3_, v4_, seed_, total_ = 0;
  unsigned char buf_[32];
  std::size_t buffered_ = 0;
};

// Reads exactly `len` bytes from file descriptor `fd` (at its current
// offset) into `dst`, in chunks hashed while still in cache; returns the
// XXH64 of those bytes with `seed`, or sets *short_read and returns 0 when
// the file ends first. Throws std::system_error on a read error.
uint64_t read_hashed(int fd, void* dst, std::size_t len, uint64_t seed, bool* short_read);

}  // namespace flashrt
