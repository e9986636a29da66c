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
// A host segment table validated and copied once, run many times: a capsule's
// snapshot or restore pays no per-call array conversions (plan/run split).
class CpuCopyPlan {
 public:
  CpuCopyPlan(const Int64Array& src, const Int64Array& dst, const Int64Array& nbytes);
  void run(int num_threads) const;  // releases the GIL
  int64_t size() const { return static_cast<int64_t>(nbytes_.size()); }

 private:
  std::vector<int64_t> src_, dst_, nbytes_;
};

#ifdef FLASHRT_SMALL_M_LINEAR
// y = x w^T at host addresses (x, y float32; w float32, or bf16 where bf16_weights; contiguous;
// the Python wrapper checks the tensors).
void small_m_linear(std::uintptr_t x, std::uintptr_t w, std::uintptr_t y, int64_t m, int64_t n,
                    int64_t k, int num_threads, bool bf16_weights);
// One row, x, w and y all bf16: y (n,) = x (k,) w (n, k)^T, rounded to bf16.
void gemv_bf16(std::uintptr_t x, std::uintptr_t w, std::uintptr_t y, int64_t n, int64_t k, int num_threads);
// The same for int8 weights w (n, k) with a bf16 scale per row (n,): y = (x w^T) * scale.
void small_m_linear_int8(std::uintptr_t x, std::uintptr_t w, std::uintptr_t scale, std::uintptr_t y,
                         int64_t m, int64_t n, int64_t k, int num_threads);
// Gated DeltaNet's rule token by token at host addresses (flashrt::GdnArgs; float32, contiguous;
// the Python wrapper checks the tensors). planes 0: none.
void gated_delta_rule(std::uintptr_t qkv, int64_t qkv_stride, int64_t q_off, int64_t k_off,
                      int64_t v_off, std::uintptr_t g, std::uintptr_t beta, std::uintptr_t state,
                      std::uintptr_t out, std::uintptr_t planes, int64_t T, int64_t hk, int64_t hv,
                      int64_t dk, int64_t dv, int num_threads);
// The same in its gated form (flashrt::GdnGate): g and beta are the raw a and b projections; out
// is the gated norm's output. bf16_io: qkv, a, b, z, norm_w and out are bf16.
void gated_delta_step(std::uintptr_t qkv, int64_t qkv_stride, int64_t q_off, int64_t k_off,
                      int64_t v_off, std::uintptr_t a, std::uintptr_t b, std::uintptr_t state,
                      std::uintptr_t out, std::uintptr_t planes, int64_t T, int64_t hk, int64_t hv,
                      int64_t dk, int64_t dv, std::uintptr_t a_log, std::uintptr_t dt_bias,
                      std::uintptr_t z, std::uintptr_t norm_w, double eps, bool round_bf16,
                      bool bf16_io, int num_threads);
// One query's attention at host addresses (flashrt::DecodeAttentionArgs; the Python wrapper
// checks the tensors).
void decode_attention(std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t out,
                      int64_t L, int64_t hq, int64_t hkv, int64_t d, double scale, bool bf16_kv,
                      int num_threads);
// RMSNorm of M rows at host addresses (flashrt::RmsNormArgs; the Python wrapper checks the tensors);
// r, s non-zero: the rows normed are s = x + r, written to s.
void rms_norm(std::uintptr_t x, std::uintptr_t w, std::uintptr_t y, int64_t M, int64_t D, double eps,
              bool zero_centred, bool bf16_x, bool bf16_w, std::uintptr_t r, std::uintptr_t s,
              int num_threads);
// silu(depthwise causal conv) at host addresses (flashrt::CausalConvArgs; the Python wrapper
// checks the tensors). planes 0: none.
void causal_conv(std::uintptr_t x, std::uintptr_t w, std::uintptr_t state, std::uintptr_t planes,
                 std::uintptr_t y, int64_t T, int64_t C, int64_t K, bool bf16);
// silu(gate) * up at host addresses (flashrt::SiluMulArgs; the Python wrapper checks the tensors).
void silu_mul(std::uintptr_t gate, std::uintptr_t up, std::uintptr_t y, int64_t M, int64_t N,
              int64_t gate_stride, int64_t up_stride, bool bf16);
#endif
std::string small_m_linear_isa();
// The weight dtypes small_m_linear takes (a build from older sources lacks this name).
std::vector<std::string> small_m_linear_weight_dtypes();

uint64_t xxh64(std::uintptr_t ptr, int64_t nbytes, uint64_t seed);
std::string xxh3_isa();
// Path of the OpenMP runtime the CPU copy runs on; "" without OpenMP.
std::string openmp_runtime();
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
// A capsule file whose metadata has exactly `keys`, `fixed` among them with
// those values (its "entries" table the one the spans and gaps were derived
// from), read in one call: ("loaded", metadata dict) with the payload in the
// buffer and its checksum verified; ("short" | "mismatch", metadata dict) when
// the payload is truncated or fails the checksum (buffer written);
// ("not_fast", None) with nothing written when the header is not in the form
// save writes or differs from what is expected. OSError on I/O errors.
pybind11::tuple load_known_table(int fd, const std::vector<std::string>& keys,
                                 const std::vector<std::pair<std::string, std::string>>& fixed,
                                 std::uintptr_t base, int64_t size,
                                 const Int64Array& offsets, const Int64Array& nbytes,
                                 const Int64Array& gap_offsets, const Int64Array& gap_nbytes,
                                 int64_t block, int num_threads);

}  // namespace launch
}  // namespace flashrt
