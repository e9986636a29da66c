// Segment tables seen as one byte stream: segment i holds stream bytes
// [start[i], start[i + 1]). Shared by the segmented copy and the block
// checksums, which both cut the stream into ranges for threads or blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace flashrt {

// Exclusive prefix sum of the segment sizes (n + 1 entries).
inline std::vector<int64_t> segment_starts(const int64_t* nbytes, int64_t n) {
  std::vector<int64_t> start(static_cast<size_t>(n) + 1, 0);
  for (int64_t i = 0; i < n; ++i) start[i + 1] = start[i] + nbytes[i];
  return start;
}

// Calls fn(i, off, len) for each non-empty part of stream bytes [lo, hi):
// `len` bytes of segment i from its byte `off`, in stream order.
template <typename F>
void for_each_piece(const std::vector<int64_t>& start, int64_t lo, int64_t hi, const F& fn) {
  if (lo >= hi) return;
  // Last segment starting at or before lo; empty segments share a start with
  // their successor, so upper_bound skips them.
  size_t i = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
  for (int64_t pos = lo; pos < hi; ++i) {
    const int64_t len = std::min(start[i + 1], hi) - pos;
    if (len > 0) fn(i, pos - start[i], len);
    pos += len;
  }
}

}  // namespace flashrt
