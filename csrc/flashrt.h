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

}  // namespace flashrt
