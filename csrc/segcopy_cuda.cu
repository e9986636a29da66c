// Device segmented copy: one kernel launch instead of one cudaMemcpyAsync per
// segment, because a state swap can touch hundreds of KV blocks and each
// launch/memcpy call costs microseconds of host time.
//
// Segment-table upload: the table travels BY VALUE in the kernel parameters
// (a __grid_constant__ struct), so a launch needs no device allocation, no
// host staging buffer, no extra memcpy and no synchronisation, and it can be
// captured into a CUDA graph. Capacity per launch is 32 / 128 / 1024 segments
// (the smallest tier that fits is used, keeping the parameter block small);
// the 1024 tier needs the 32 KiB parameter limit of CUDA >= 12.1 (runtime
// and driver) and sm_70+, otherwise tables are cut into 128-segment chunks.
// Only past the capacity does the host issue more launches, all on `stream`.
// Requires CUDA >= 11.7 and sm_70+ (__grid_constant__). Kernels load lazily:
// run a copy once before capturing one into a CUDA graph.
//
// Work split: every segment is cut into 16 KiB tiles; block b copies tiles
// b, b + gridDim.x, ... and finds its tile's segment by a binary search over
// the tiles' prefix sums. The search is uniform across the block, so its
// parameter-bank reads are broadcasts. Inside a tile, threads copy 16-byte
// vectors when src and dst share 16-byte alignment (8/4/1 otherwise).
#include "flashrt.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <memory>
#include <stdexcept>
#include <string>

namespace flashrt {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kTile = int64_t{kThreads} * 16 * kUnroll;  // 16 KiB
constexpr int kMaxBlocks = 2048;  // ~2 waves on an H200; grid-stride beyond
#if CUDART_VERSION >= 12010
constexpr int kBigCap = 1024;  // 28 * 1024 + 8 bytes < 32764-byte limit
#else
constexpr int kBigCap = 128;  // 28 * 128 + 8 bytes < 4096-byte limit
#endif

// Unroll hint for the device pass only; host compilers warn on the pragma.
#ifdef __CUDA_ARCH__
#define FLASHRT_UNROLL _Pragma("unroll")
#else
#define FLASHRT_UNROLL
#endif

__host__ __device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

template <int Cap>
struct Table {
  const unsigned char* src[Cap];
  unsigned char* dst[Cap];
  int64_t nbytes[Cap];
  int32_t tile_start[Cap + 1];  // prefix sum of tiles; tile_start[n] = total
  int32_t n;
};

// Copies len bytes with V-sized accesses where possible. p and q must be
// congruent modulo sizeof(V), so one byte prologue aligns both.
template <typename V>
__host__ __device__ void copy_span(const unsigned char* p, unsigned char* q, int64_t len,
                                   int tid, int nt) {
  constexpr int64_t W = sizeof(V);
  const int64_t head = min64(len, (W - static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) & (W - 1))) & (W - 1));
  const int64_t nvec = (len - head) / W;
  const V* s = reinterpret_cast<const V*>(p + head);
  V* d = reinterpret_cast<V*>(q + head);
  if (nvec == int64_t{nt} * kUnroll) {
    // Full tile: issue all loads before any store so kUnroll requests per
    // thread are in flight (the compiler cannot reorder across the aliasing
    // stores by itself).
    V r[kUnroll];
    FLASHRT_UNROLL
    for (int k = 0; k < kUnroll; ++k) r[k] = s[tid + k * nt];
    FLASHRT_UNROLL
    for (int k = 0; k < kUnroll; ++k) d[tid + k * nt] = r[k];
  } else {
    for (int64_t i = tid; i < nvec; i += nt) d[i] = s[i];
  }
  for (int64_t i = tid; i < head; i += nt) q[i] = p[i];
  for (int64_t i = head + nvec * W + tid; i < len; i += nt) q[i] = p[i];
}

template <int Cap>
__host__ __device__ void copy_tile(const Table<Cap>& t, int64_t tile, int tid, int nt) {
  int lo = 0, hi = t.n;  // invariant: tile_start[lo] <= tile < tile_start[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (t.tile_start[mid] <= tile) lo = mid; else hi = mid;
  }
  const int64_t off = (tile - t.tile_start[lo]) * kTile;
  const unsigned char* p = t.src[lo] + off;
  unsigned char* q = t.dst[lo] + off;
  const int64_t len = min64(kTile, t.nbytes[lo] - off);
  const uintptr_t mis = reinterpret_cast<uintptr_t>(p) ^ reinterpret_cast<uintptr_t>(q);
  if ((mis & 15) == 0) copy_span<uint4>(p, q, len, tid, nt);
  else if ((mis & 7) == 0) copy_span<unsigned long long>(p, q, len, tid, nt);
  else if ((mis & 3) == 0) copy_span<unsigned int>(p, q, len, tid, nt);
  else copy_span<unsigned char>(p, q, len, tid, nt);
}

// __grid_constant__ lets copy_tile take the table by reference without the
// compiler spilling a per-thread copy of up to 28 KiB to local memory.
template <int Cap>
__global__ void __launch_bounds__(kThreads) segcopy_kernel(const __grid_constant__ Table<Cap> t) {
  for (int64_t tile = blockIdx.x; tile < t.tile_start[t.n]; tile += gridDim.x)
    copy_tile(t, tile, threadIdx.x, blockDim.x);
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("flashrt segcopy_cuda: ") + what + ": " +
                             cudaGetErrorString(err));
}

// Packs non-empty segments into tables of Cap and hands each full table (and
// the final partial one) to `emit`; the caller picks Cap so that usually a
// single table suffices. Kept apart from the launch so it can be tested on
// a host without a GPU.
template <int Cap, typename Emit>
void pack_tables(const int64_t* src, const int64_t* dst, const int64_t* nbytes, int64_t n,
                 Emit&& emit) {
  auto t = std::make_unique<Table<Cap>>();  // heap: up to 28 KiB, threads may have small stacks
  t->n = 0;
  t->tile_start[0] = 0;
  auto flush = [&] {
    if (t->n == 0) return;
    emit(*t);
    t->n = 0;
  };
  for (int64_t i = 0; i < n; ++i) {
    if (nbytes[i] == 0) continue;
    const int64_t tiles = (nbytes[i] + kTile - 1) / kTile;
    if (tiles > INT32_MAX - t->tile_start[t->n]) flush();  // > 32 TiB in one table
    if (tiles > INT32_MAX) throw std::invalid_argument("segcopy_cuda: segment too large");
    const int32_t k = t->n;
    t->src[k] = reinterpret_cast<const unsigned char*>(src[i]);
    t->dst[k] = reinterpret_cast<unsigned char*>(dst[i]);
    t->nbytes[k] = nbytes[i];
    t->tile_start[k + 1] = t->tile_start[k] + static_cast<int32_t>(tiles);
    t->n = k + 1;
    if (t->n == Cap) flush();
  }
  flush();
}

template <int Cap>
void launch_all(const int64_t* src, const int64_t* dst, const int64_t* nbytes, int64_t n,
                cudaStream_t stream) {
  pack_tables<Cap>(src, dst, nbytes, n, [stream](const Table<Cap>& t) {
    const int32_t tiles = t.tile_start[t.n];
    segcopy_kernel<Cap><<<std::min(tiles, kMaxBlocks), kThreads, 0, stream>>>(t);
    check(cudaGetLastError(), "kernel launch");
  });
}

// Parameter blocks above 4 KiB also need a CUDA >= 12.1 driver; ask once.
bool big_params_ok() {
  static const bool ok = [] {
    int v = 0;
    return cudaDriverGetVersion(&v) == cudaSuccess && v >= 12010;
  }();
  return ok;
}

}  // namespace

void segcopy_cuda(const int64_t* src, const int64_t* dst, const int64_t* nbytes, int64_t n,
                  std::uintptr_t stream_handle) {
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  int64_t live = 0;
  for (int64_t i = 0; i < n; ++i) live += nbytes[i] != 0;
  if (live == 0) return;
  if (live <= 32) launch_all<32>(src, dst, nbytes, n, stream);
  else if (live <= 128 || kBigCap == 128 || !big_params_ok()) launch_all<128>(src, dst, nbytes, n, stream);
  else launch_all<kBigCap>(src, dst, nbytes, n, stream);
}

}  // namespace flashrt
