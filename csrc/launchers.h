// Launcher layer: validates Python-provided tables and buffers, releases the
// GIL, then calls the raw kernels in flashrt.h. bindings.cpp only exports.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace flashrt {
namespace launch {

// No forcecast: numpy may widen int32 -> int64 but never truncates floats
// into bogus addresses; such calls fail with TypeError.
using Int64Array = pybind11::array_t<int64_t, pybind11::array::c_style>;

void copy_segments_cpu(const Int64Array& src, const Int64Array& dst, const Int64Array& nbytes,
                       int num_threads);
#ifdef FLASHRT_WITH_CUDA
void copy_segments_cuda(const Int64Array& src, const Int64Array& dst, const Int64Array& nbytes,
                        std::uintptr_t stream);
#endif
uint64_t xxh64(std::uintptr_t ptr, int64_t nbytes, uint64_t seed);
std::string xxh3_isa();
// XXH3-64 of the parts (bytes-like, contiguous) concatenated, without joining them.
uint64_t xxh3_parts(const std::vector<pybind11::buffer>& parts);
// Zero the spans (offset, nbytes) of the host buffer [base, base + size).
void zero_spans(std::uintptr_t base, int64_t size, const Int64Array& offsets, const Int64Array& nbytes);
// Spans are (offset, nbytes) inside the buffer [base, base + size), in stream order.
pybind11::bytes hash_blocks(std::uintptr_t base, int64_t size, const Int64Array& offsets,
                            const Int64Array& nbytes, int64_t block, int num_threads);
pybind11::object read_blocks_hashed(int fd, int64_t file_offset, std::uintptr_t base, int64_t size,
                                    const Int64Array& offsets, const Int64Array& nbytes,
                                    int64_t block, int num_threads);

}  // namespace launch
}  // namespace flashrt
