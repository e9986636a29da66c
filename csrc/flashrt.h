// Kernel layer of flashrt.native._C: plain C++ on raw pointers, no Python and no
// CUDA headers, so each kernel can be built (and reused) on its own.
// Segment tables are three parallel int64 arrays: src address, dst address,
// byte count. Addresses are integers because the Python side hands us
// torch data_ptr()s; the extension deliberately does not link libtorch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flashrt {

// Copies every segment on the host. Large volumes are split evenly by bytes
// (not by segment) over up to num_threads threads (0 = OpenMP's thread count,
// which torch sets, or hardware concurrency in a build without OpenMP).
// Segments must not overlap each other's destinations or their own source.
void segcopy_cpu(const int64_t* src, const int64_t* dst, const int64_t* nbytes,
                 int64_t n, int num_threads);

// The OpenMP runtime library segcopy_cpu's parallel copies run on (its path,
// as the dynamic linker resolved it), or "" in a build without OpenMP.
const char* openmp_runtime();

// Copies every segment with one kernel launch on `stream` (a cudaStream_t
// as an integer) for up to a few hundred segments; see segcopy_cuda.cu.
// Asynchronous with respect to the host, like cudaMemcpyAsync.
void segcopy_cuda(const int64_t* src, const int64_t* dst, const int64_t* nbytes,
                  int64_t n, std::uintptr_t stream);

// y (M, N) = x (M, K) w (N, K)^T, float32, all row-major and contiguous, for
// small M (see linear_cpu.cpp; x86-64 builds only). Threads split the columns
// (0 = OpenMP's thread count); results do not depend on it.
void small_m_linear(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                    int num_threads);
// The same with bf16 weights (raw 16-bit patterns), widened to float32 in registers.
void small_m_linear_bf16w(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N,
                          int64_t K, int num_threads);
// One row of bf16 x against bf16 weights, y (N,) written as bf16 (rounded to nearest even).
void gemv_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t N, int64_t K, int num_threads);
// The same with int8 weights and a bf16 scale per weight row: y = (x w^T) * scale.
void small_m_linear_int8w(const float* x, const int8_t* w, const uint16_t* scale, float* y,
                          int64_t M, int64_t N, int64_t K, int num_threads);

// Gated DeltaNet's rule token by token (gdn_cpu.cpp; x86-64 AVX2 + FMA builds). qkv (T rows,
// qkv_stride floats apart) holds q, k (hk heads of dk) and v (hv heads of dv) at q_off, k_off,
// v_off; g (log decay) and beta (T, hv); state (hv, dk, dv) updated in place; out (T, hv, dv);
// planes (T, hv, dk, dv) or null: the state after each token. All float32, contiguous.
// Gated form (GdnArgs::gate): g holds the raw a projection and beta the raw b, (T, hv):
// beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias); out per head is
// rmsnorm(o) * norm_w * silu(z), z (T, hv * dv). round_bf16: each step rounded to bf16 where a
// bf16 model's torch form rounds (beta, o, the norm, its weight product, the output).
// bf16_io (gated form only, with round_bf16): qkv, g, beta, z, norm_w and out are bf16 (a bf16
// model's own tensors, no float32 copies); the state and a_log, dt_bias stay float32.
struct GdnGate {
  const float* a_log;
  const float* dt_bias;
  const void* z;
  const void* norm_w;
  float eps;
  bool round_bf16;
};
struct GdnArgs {
  const void* qkv;
  int64_t qkv_stride, q_off, k_off, v_off;
  const void* g;
  const void* beta;
  float* state;
  void* out;
  float* planes;
  int64_t T, hk, hv, dk, dv;
  const GdnGate* gate;   // null: the rule alone
  bool bf16_io;
};
void gated_delta_rule_cpu(const GdnArgs& args, int num_threads);

// One query's attention over L cached rows (attention_cpu.cpp; x86-64 AVX2 + FMA builds): q
// (hq, d) float32; k, v rows of (hkv, d), float32 or bf16 (bf16_kv), row l at l * hkv * d;
// out (hq, d) float32 = softmax(scale * q K^T) V per query head, kv head h / (hq / hkv).
struct DecodeAttentionArgs {
  const float* q;
  const void* k;
  const void* v;
  float* out;
  int64_t L, hq, hkv, d;
  float scale;
  bool bf16_kv;
};
void decode_attention_cpu(const DecodeAttentionArgs& args, int num_threads);

// RMSNorm of M rows of D (norm_cpu.cpp; x86-64 AVX2 + FMA builds): x and y float32 or bf16
// (bf16_x), w (D,) float32 or bf16 (bf16_w); y = x / rms(x) * (zero_centred ? 1 + w : w).
// r and s (M, D) in x's dtype, or both null: normed is s = x + r (rounded to bf16 in a bf16
// model, as torch's add), written to s.
struct RmsNormArgs {
  const void* x;
  const void* w;
  void* y;
  int64_t M, D;
  float eps;
  bool zero_centred, bf16_x, bf16_w;
  const void* r;
  void* s;
};
void rms_norm_cpu(const RmsNormArgs& args, int num_threads);

// silu(depthwise causal conv) of T rows of C channels (conv_cpu.cpp; x86-64 builds), one dtype
// for all (float32, or bf16 where bf16): x (T, C), w (C, K), state (C, K-1) the left context,
// updated in place; y (T, C); planes (T, C, K-1), the state after each row, or null.
struct CausalConvArgs {
  const void* x;
  const void* w;
  void* state;
  void* planes;
  void* y;
  int64_t T, C, K;
  bool bf16;
};
void causal_conv_cpu(const CausalConvArgs& args);

// y (M, N) = silu(gate) * up over M rows (activation_cpu.cpp; x86-64 AVX2 + FMA builds), one
// dtype (float32, or bf16 where bf16); gate and up rows gate_stride and up_stride apart.
struct SiluMulArgs {
  const void* gate;
  const void* up;
  void* y;
  int64_t M, N, gate_stride, up_stride;
  bool bf16;
};
void silu_mul_cpu(const SiluMulArgs& args);

// Whether this process was forked after the module loaded (libgomp's threads are then gone:
// parallel regions must not run; see segcopy_cpu.cpp).
bool forked_after_load();

// Standard XXH64 (the vendored reference, see xxhash.cpp).
uint64_t xxh64(const void* data, std::size_t len, uint64_t seed);

// A read-only byte range.
struct ByteSpan {
  const void* data;
  std::size_t len;
};

// XXH3-64 (seed 0, default secret) of the spans concatenated; see xxhash.cpp.
uint64_t xxh3_64(const ByteSpan* spans, std::size_t n);
// "avx2" or "baseline": the code xxh3_64 runs on this CPU.
const char* xxh3_isa();

// Checksums of a byte stream given as segments in stream order: digests[b]
// is the XXH3-64 (seed 0) of stream bytes [b * block, min((b + 1) * block,
// total)), for ceil(total / block) blocks. Blocks are split over up to
// num_threads threads (0 = all cores); the digests never depend on that.
void hash_blocks(const int64_t* addr, const int64_t* nbytes, int64_t n, int64_t block,
                 uint64_t* digests, int num_threads);

// Reads the stream from file descriptor `fd`, starting at byte `offset`
// (pread: the descriptor's own offset is untouched), into the segments and
// returns the digests hash_blocks would give, each block hashed right after
// it is read. Returns false when the file ends first (digests then partial);
// throws std::system_error on a read error.
bool read_blocks_hashed(int fd, int64_t offset, const int64_t* addr, const int64_t* nbytes,
                        int64_t n, int64_t block, uint64_t* digests, int num_threads);

// A capsule file's metadata: its string-valued keys in file order.
struct MetadataItem {
  std::string key, value;
};

enum class KnownLoad {
  kLoaded,    // payload in the segments, checksum verified; *md holds the metadata
  kNotFast,   // header not in the form save writes, other keys or values than expected, or
              // sizes that differ: nothing written, the general reader takes the file
  kShort,     // the file ended inside the payload (*md parsed; buffer partly written)
  kMismatch,  // checksum mismatch (*md parsed; buffer written)
};

// Loads a capsule file (format 4, see flashrt/capsules/format.py) whose metadata has
// exactly the keys `keys`, with the values `fixed` for some of them: among
// those the "entries" table the segments (the payload stream in file order)
// and the gaps (zeroed) were derived from. Anything else about the header is
// kNotFast, before a byte is written. Reads with pread (the descriptor's
// offset is untouched); throws std::system_error on I/O errors.
KnownLoad load_known_table(int fd, const std::vector<std::string>& keys,
                           const std::vector<MetadataItem>& fixed, const int64_t* addr,
                           const int64_t* nbytes, int64_t n, const int64_t* gap_addr,
                           const int64_t* gap_nbytes, int64_t ngaps, int64_t block,
                           int num_threads, std::vector<MetadataItem>* md);

}  // namespace flashrt
