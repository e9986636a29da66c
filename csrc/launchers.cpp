#include "launchers.h"

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <string>
#include <vector>

#include "flashrt.h"

namespace py = pybind11;

namespace flashrt {
namespace launch {
namespace {

// std::invalid_argument surfaces in Python as ValueError.
void check_table(const Int64Array& src, const Int64Array& dst, const Int64Array& nbytes) {
  if (src.ndim() != 1 || dst.ndim() != 1 || nbytes.ndim() != 1)
    throw std::invalid_argument("segment tables must be 1-D int64 arrays");
  if (src.shape(0) != nbytes.shape(0) || dst.shape(0) != nbytes.shape(0))
    throw std::invalid_argument("segment tables differ in length: src " + std::to_string(src.shape(0)) +
                                ", dst " + std::to_string(dst.shape(0)) + ", nbytes " +
                                std::to_string(nbytes.shape(0)));
  const int64_t *s = src.data(), *d = dst.data(), *nb = nbytes.data();
  for (py::ssize_t i = 0; i < nbytes.shape(0); ++i) {
    if (nb[i] < 0)
      throw std::invalid_argument("segment " + std::to_string(i) + ": negative nbytes");
    if (nb[i] > 0 && (s[i] == 0 || d[i] == 0))
      throw std::invalid_argument("segment " + std::to_string(i) + ": null address");
  }
}

}  // namespace

void copy_segments_cpu(const Int64Array& src, const Int64Array& dst, const Int64Array& nbytes,
                       int num_threads) {
  check_table(src, dst, nbytes);
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = all cores)");
  py::gil_scoped_release nogil;  // the arrays stay alive: the caller holds them
  segcopy_cpu(src.data(), dst.data(), nbytes.data(), nbytes.shape(0), num_threads);
}

CpuCopyPlan::CpuCopyPlan(const Int64Array& src, const Int64Array& dst, const Int64Array& nbytes) {
  check_table(src, dst, nbytes);
  const py::ssize_t n = nbytes.shape(0);
  src_.assign(src.data(), src.data() + n);
  dst_.assign(dst.data(), dst.data() + n);
  nbytes_.assign(nbytes.data(), nbytes.data() + n);
}

void CpuCopyPlan::run(int num_threads) const {
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = all cores)");
  py::gil_scoped_release nogil;  // the tables are the plan's own; the caller keeps the buffers
  segcopy_cpu(src_.data(), dst_.data(), nbytes_.data(), size(), num_threads);
}

#ifdef FLASHRT_SMALL_M_LINEAR
// Checked here, in code built for the baseline ISA: linear_cpu.cpp is built for AVX2 + FMA.
std::string small_m_linear_isa() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok ? "avx2-fma" : "";
}

namespace {
void check_small_m(const char* name, std::uintptr_t x, std::uintptr_t w, std::uintptr_t y, int64_t m,
                   int64_t n, int64_t k, int num_threads) {
  const std::string fn(name);
  if (small_m_linear_isa().empty())
    throw std::runtime_error(fn + " needs AVX2 and FMA, which this CPU lacks");
  if (m <= 0 || n <= 0 || k <= 0)
    throw std::invalid_argument(fn + ": m, n, k must be positive, got " + std::to_string(m) +
                                ", " + std::to_string(n) + ", " + std::to_string(k));
  if (x == 0 || w == 0 || y == 0) throw std::invalid_argument(fn + ": null address");
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = all cores)");
}
}  // namespace

void small_m_linear(std::uintptr_t x, std::uintptr_t w, std::uintptr_t y, int64_t m, int64_t n,
                    int64_t k, int num_threads, bool bf16_weights) {
  check_small_m("small_m_linear", x, w, y, m, n, k, num_threads);
  py::gil_scoped_release nogil;  // the caller holds the tensors
  if (bf16_weights)
    flashrt::small_m_linear_bf16w(reinterpret_cast<const float*>(x), reinterpret_cast<const uint16_t*>(w),
                                  reinterpret_cast<float*>(y), m, n, k, num_threads);
  else
    flashrt::small_m_linear(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(w),
                            reinterpret_cast<float*>(y), m, n, k, num_threads);
}

void gemv_bf16(std::uintptr_t x, std::uintptr_t w, std::uintptr_t y, int64_t n, int64_t k, int num_threads) {
  check_small_m("gemv_bf16", x, w, y, 1, n, k, num_threads);
  py::gil_scoped_release nogil;  // the caller holds the tensors
  flashrt::gemv_bf16(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(w),
                     reinterpret_cast<uint16_t*>(y), n, k, num_threads);
}

void small_m_linear_int8(std::uintptr_t x, std::uintptr_t w, std::uintptr_t scale, std::uintptr_t y,
                         int64_t m, int64_t n, int64_t k, int num_threads) {
  check_small_m("small_m_linear_int8", x, w, y, m, n, k, num_threads);
  if (scale == 0) throw std::invalid_argument("small_m_linear_int8: null scale address");
  py::gil_scoped_release nogil;  // the caller holds the tensors
  flashrt::small_m_linear_int8w(reinterpret_cast<const float*>(x), reinterpret_cast<const int8_t*>(w),
                                reinterpret_cast<const uint16_t*>(scale), reinterpret_cast<float*>(y),
                                m, n, k, num_threads);
}

namespace {
// What gated_delta_rule and gated_delta_step both check (fn names the caller).
void check_gdn(const std::string& fn, std::uintptr_t qkv, int64_t qkv_stride, int64_t q_off,
               int64_t k_off, int64_t v_off, std::uintptr_t g, std::uintptr_t beta,
               std::uintptr_t state, std::uintptr_t out, int64_t T, int64_t hk, int64_t hv,
               int64_t dk, int64_t dv, int num_threads) {
  if (small_m_linear_isa().empty()) throw std::runtime_error(fn + " needs AVX2 and FMA, which this CPU lacks");
  if (T <= 0 || hk <= 0 || hv <= 0 || hv % hk != 0)
    throw std::invalid_argument(fn + ": T, hk, hv must be positive with hv a multiple of hk, got " +
                                std::to_string(T) + ", " + std::to_string(hk) + ", " + std::to_string(hv));
  if (dk <= 0 || dv <= 0 || dk > 512 || dv > 512)
    throw std::invalid_argument(fn + ": head dims must be in 1..512, got dk " + std::to_string(dk) +
                                ", dv " + std::to_string(dv));
  if (q_off < 0 || k_off < 0 || v_off < 0 || q_off + hk * dk > qkv_stride ||
      k_off + hk * dk > qkv_stride || v_off + hv * dv > qkv_stride)
    throw std::invalid_argument(fn + ": q, k, v do not fit a qkv row of " + std::to_string(qkv_stride) +
                                " floats");
  if (qkv == 0 || g == 0 || beta == 0 || state == 0 || out == 0)
    throw std::invalid_argument(fn + ": null address");
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = all cores)");
}
}  // namespace

void gated_delta_rule(std::uintptr_t qkv, int64_t qkv_stride, int64_t q_off, int64_t k_off,
                      int64_t v_off, std::uintptr_t g, std::uintptr_t beta, std::uintptr_t state,
                      std::uintptr_t out, std::uintptr_t planes, int64_t T, int64_t hk, int64_t hv,
                      int64_t dk, int64_t dv, int num_threads) {
  check_gdn("gated_delta_rule", qkv, qkv_stride, q_off, k_off, v_off, g, beta, state, out, T, hk, hv,
            dk, dv, num_threads);
  const GdnArgs a{reinterpret_cast<const void*>(qkv), qkv_stride, q_off, k_off, v_off,
                  reinterpret_cast<const void*>(g), reinterpret_cast<const void*>(beta),
                  reinterpret_cast<float*>(state), reinterpret_cast<void*>(out),
                  reinterpret_cast<float*>(planes), T, hk, hv, dk, dv, nullptr, false};
  py::gil_scoped_release nogil;  // the caller holds the tensors
  gated_delta_rule_cpu(a, num_threads);
}

void gated_delta_step(std::uintptr_t qkv, int64_t qkv_stride, int64_t q_off, int64_t k_off,
                      int64_t v_off, std::uintptr_t a, std::uintptr_t b, std::uintptr_t state,
                      std::uintptr_t out, std::uintptr_t planes, int64_t T, int64_t hk, int64_t hv,
                      int64_t dk, int64_t dv, std::uintptr_t a_log, std::uintptr_t dt_bias,
                      std::uintptr_t z, std::uintptr_t norm_w, double eps, bool round_bf16,
                      bool bf16_io, int num_threads) {
  if (a_log == 0 || dt_bias == 0 || z == 0 || norm_w == 0)
    throw std::invalid_argument("gated_delta_step: null address");
  if (!(eps >= 0)) throw std::invalid_argument("gated_delta_step: eps must be >= 0");
  if (bf16_io && !round_bf16)
    throw std::invalid_argument("gated_delta_step: bf16_io takes round_bf16 (a bf16 model rounds as it goes)");
  const GdnGate gate{reinterpret_cast<const float*>(a_log), reinterpret_cast<const float*>(dt_bias),
                     reinterpret_cast<const void*>(z), reinterpret_cast<const void*>(norm_w),
                     static_cast<float>(eps), round_bf16};
  check_gdn("gated_delta_step", qkv, qkv_stride, q_off, k_off, v_off, a, b, state, out, T, hk, hv, dk,
            dv, num_threads);
  const GdnArgs args{reinterpret_cast<const void*>(qkv), qkv_stride, q_off, k_off, v_off,
                     reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b),
                     reinterpret_cast<float*>(state), reinterpret_cast<void*>(out),
                     reinterpret_cast<float*>(planes), T, hk, hv, dk, dv, &gate, bf16_io};
  py::gil_scoped_release nogil;  // the caller holds the tensors
  gated_delta_rule_cpu(args, num_threads);
}

void decode_attention(std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t out,
                      int64_t L, int64_t hq, int64_t hkv, int64_t d, double scale, bool bf16_kv,
                      int num_threads) {
  if (small_m_linear_isa().empty())
    throw std::runtime_error("decode_attention needs AVX2 and FMA, which this CPU lacks");
  if (L <= 0 || hq <= 0 || hkv <= 0 || hq % hkv != 0)
    throw std::invalid_argument("decode_attention: L, hq, hkv must be positive with hq a multiple of hkv, got " +
                                std::to_string(L) + ", " + std::to_string(hq) + ", " + std::to_string(hkv));
  if (d <= 0 || d % 8 != 0)
    throw std::invalid_argument("decode_attention: head dim must be a positive multiple of 8, got " +
                                std::to_string(d));
  if (q == 0 || k == 0 || v == 0 || out == 0) throw std::invalid_argument("decode_attention: null address");
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = all cores)");
  const DecodeAttentionArgs a{reinterpret_cast<const float*>(q), reinterpret_cast<const void*>(k),
                              reinterpret_cast<const void*>(v), reinterpret_cast<float*>(out),
                              L, hq, hkv, d, static_cast<float>(scale), bf16_kv};
  py::gil_scoped_release nogil;  // the caller holds the tensors
  decode_attention_cpu(a, num_threads);
}
void rms_norm(std::uintptr_t x, std::uintptr_t w, std::uintptr_t y, int64_t M, int64_t D, double eps,
              bool zero_centred, bool bf16_x, bool bf16_w, std::uintptr_t r, std::uintptr_t s,
              int num_threads) {
  if ((r == 0) != (s == 0)) throw std::invalid_argument("rms_norm: a residual takes a sum to write (r and s)");
  if (small_m_linear_isa().empty())
    throw std::runtime_error("rms_norm needs AVX2 and FMA, which this CPU lacks");
  if (M <= 0 || D <= 0)
    throw std::invalid_argument("rms_norm: M and D must be positive, got " + std::to_string(M) + ", " +
                                std::to_string(D));
  if (!(eps >= 0)) throw std::invalid_argument("rms_norm: eps must be >= 0");
  if (x == 0 || w == 0 || y == 0) throw std::invalid_argument("rms_norm: null address");
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = all cores)");
  const RmsNormArgs a{reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(w),
                      reinterpret_cast<void*>(y), M, D, static_cast<float>(eps), zero_centred, bf16_x, bf16_w,
                      reinterpret_cast<const void*>(r), reinterpret_cast<void*>(s)};
  py::gil_scoped_release nogil;  // the caller holds the tensors
  rms_norm_cpu(a, num_threads);
}
void causal_conv(std::uintptr_t x, std::uintptr_t w, std::uintptr_t state, std::uintptr_t planes,
                 std::uintptr_t y, int64_t T, int64_t C, int64_t K, bool bf16) {
  if (small_m_linear_isa().empty())
    throw std::runtime_error("causal_conv needs AVX2 and FMA, which this CPU lacks");
  if (T <= 0 || C <= 0 || K < 2 || K > 64)
    throw std::invalid_argument("causal_conv: T, C must be positive and K in 2..64, got " + std::to_string(T) +
                                ", " + std::to_string(C) + ", " + std::to_string(K));
  if (x == 0 || w == 0 || state == 0 || y == 0) throw std::invalid_argument("causal_conv: null address");
  const CausalConvArgs a{reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(w),
                         reinterpret_cast<void*>(state), reinterpret_cast<void*>(planes),
                         reinterpret_cast<void*>(y), T, C, K, bf16};
  py::gil_scoped_release nogil;  // the caller holds the tensors
  causal_conv_cpu(a);
}
void silu_mul(std::uintptr_t gate, std::uintptr_t up, std::uintptr_t y, int64_t M, int64_t N,
              int64_t gate_stride, int64_t up_stride, bool bf16) {
  if (small_m_linear_isa().empty())
    throw std::runtime_error("silu_mul needs AVX2 and FMA, which this CPU lacks");
  if (M <= 0 || N <= 0 || gate_stride < N || up_stride < N)
    throw std::invalid_argument("silu_mul: M, N must be positive and the row strides at least N, got " +
                                std::to_string(M) + ", " + std::to_string(N) + ", " + std::to_string(gate_stride) +
                                ", " + std::to_string(up_stride));
  if (gate == 0 || up == 0 || y == 0) throw std::invalid_argument("silu_mul: null address");
  const SiluMulArgs a{reinterpret_cast<const void*>(gate), reinterpret_cast<const void*>(up),
                      reinterpret_cast<void*>(y), M, N, gate_stride, up_stride, bf16};
  py::gil_scoped_release nogil;  // the caller holds the tensors
  silu_mul_cpu(a);
}
#else
std::string small_m_linear_isa() { return ""; }
#endif

std::vector<std::string> small_m_linear_weight_dtypes() { return {"float32", "bfloat16", "int8"}; }

#ifdef FLASHRT_WITH_CUDA
void copy_segments_cuda(const Int64Array& src, const Int64Array& dst, const Int64Array& nbytes,
                        std::uintptr_t stream) {
  check_table(src, dst, nbytes);
  py::gil_scoped_release nogil;
  segcopy_cuda(src.data(), dst.data(), nbytes.data(), nbytes.shape(0), stream);
}
#endif

uint64_t xxh64(std::uintptr_t ptr, int64_t nbytes, uint64_t seed) {
  if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0");
  if (nbytes > 0 && ptr == 0) throw std::invalid_argument("null pointer");
  py::gil_scoped_release nogil;
  return flashrt::xxh64(reinterpret_cast<const void*>(ptr), static_cast<std::size_t>(nbytes), seed);
}

std::string xxh3_isa() { return flashrt::xxh3_isa(); }

std::string openmp_runtime() { return flashrt::openmp_runtime(); }

namespace {

// Segment addresses inside [base, base + size) from offsets; rejects what would
// touch memory outside the buffer.
std::vector<int64_t> spans_to_addresses(std::uintptr_t base, int64_t size, const Int64Array& offsets,
                                        const Int64Array& nbytes, int64_t block, const char* who) {
  if (offsets.ndim() != 1 || nbytes.ndim() != 1 || offsets.shape(0) != nbytes.shape(0))
    throw std::invalid_argument(std::string(who) + ": offsets and nbytes must be 1-D int64 arrays "
                                "of one length");
  if (block <= 0) throw std::invalid_argument(std::string(who) + ": block must be > 0");
  if (size < 0 || (size > 0 && base == 0))
    throw std::invalid_argument(std::string(who) + ": bad buffer (null or negative size)");
  const int64_t *off = offsets.data(), *nb = nbytes.data();
  std::vector<int64_t> addr(static_cast<size_t>(nbytes.shape(0)));
  for (py::ssize_t i = 0; i < nbytes.shape(0); ++i) {
    if (off[i] < 0 || nb[i] < 0 || nb[i] > size - off[i])
      throw std::invalid_argument(std::string(who) + ": span " + std::to_string(i) + " [" +
                                  std::to_string(off[i]) + ", +" + std::to_string(nb[i]) +
                                  ") lies outside the " + std::to_string(size) + " B buffer");
    addr[i] = static_cast<int64_t>(base) + off[i];
  }
  return addr;
}

// Digests as little-endian u64s: the format stores them as bytes.
py::bytes digest_bytes(std::vector<uint64_t>& d) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  for (auto& x : d) x = __builtin_bswap64(x);
#endif
  return py::bytes(reinterpret_cast<const char*>(d.data()), d.size() * sizeof(uint64_t));
}

int64_t stream_blocks(const Int64Array& nbytes, int64_t block) {
  int64_t total = 0;
  for (py::ssize_t i = 0; i < nbytes.shape(0); ++i) total += nbytes.data()[i];
  return (total + block - 1) / block;
}

// Runs file I/O with the GIL released; a std::system_error becomes OSError(errno)
// once the GIL is held again.
template <typename F>
auto io_without_gil(const F& fn) -> decltype(fn()) {
  int err = 0;
  {
    py::gil_scoped_release nogil;
    try {
      return fn();
    } catch (const std::system_error& e) {
      err = e.code().value();
    }
  }
  errno = err;
  PyErr_SetFromErrno(PyExc_OSError);
  throw py::error_already_set();
}

}  // namespace

uint64_t xxh3_parts(const std::vector<py::buffer>& parts) {
  std::vector<py::buffer_info> infos;   // keep each buffer exported while hashing
  std::vector<ByteSpan> spans;
  infos.reserve(parts.size());
  spans.reserve(parts.size());
  for (const auto& p : parts) {
    infos.push_back(p.request());
    const auto& bi = infos.back();
    const bool c_contiguous = bi.ndim <= 1 && (bi.ndim == 0 || bi.strides[0] == bi.itemsize);
    if (!c_contiguous) throw std::invalid_argument("xxh3_parts: every part must be a contiguous buffer");
    spans.push_back({bi.ptr, static_cast<std::size_t>(bi.size * bi.itemsize)});
  }
  py::gil_scoped_release nogil;
  return flashrt::xxh3_64(spans.data(), spans.size());
}

void zero_spans(std::uintptr_t base, int64_t size, const Int64Array& offsets, const Int64Array& nbytes) {
  const auto addr = spans_to_addresses(base, size, offsets, nbytes, 1, "zero_spans");
  const int64_t* nb = nbytes.data();
  for (size_t i = 0; i < addr.size(); ++i)
    std::memset(reinterpret_cast<void*>(addr[i]), 0, static_cast<std::size_t>(nb[i]));
}

py::bytes hash_blocks(std::uintptr_t base, int64_t size, const Int64Array& offsets,
                      const Int64Array& nbytes, int64_t block, int num_threads) {
  const auto addr = spans_to_addresses(base, size, offsets, nbytes, block, "hash_blocks");
  std::vector<uint64_t> d(static_cast<size_t>(stream_blocks(nbytes, block)));
  {
    py::gil_scoped_release nogil;
    flashrt::hash_blocks(addr.data(), nbytes.data(), nbytes.shape(0), block, d.data(), num_threads);
  }
  return digest_bytes(d);
}

// The digests as bytes, or None when the file ended before the stream did.
py::object read_blocks_hashed(int fd, int64_t file_offset, std::uintptr_t base, int64_t size,
                              const Int64Array& offsets, const Int64Array& nbytes, int64_t block,
                              int num_threads) {
  if (fd < 0) throw std::invalid_argument("read_blocks_hashed: bad file descriptor");
  if (file_offset < 0) throw std::invalid_argument("read_blocks_hashed: negative file offset");
  const auto addr = spans_to_addresses(base, size, offsets, nbytes, block, "read_blocks_hashed");
  std::vector<uint64_t> d(static_cast<size_t>(stream_blocks(nbytes, block)));
  const bool complete = io_without_gil([&] {
    return flashrt::read_blocks_hashed(fd, file_offset, addr.data(), nbytes.data(), nbytes.shape(0),
                                       block, d.data(), num_threads);
  });
  if (!complete) return py::none();
  return digest_bytes(d);
}

// (status, metadata dict or None); see launchers.h.
py::tuple load_known_table(int fd, const std::vector<std::string>& keys,
                           const std::vector<std::pair<std::string, std::string>>& fixed,
                           std::uintptr_t base, int64_t size,
                           const Int64Array& offsets, const Int64Array& nbytes,
                           const Int64Array& gap_offsets, const Int64Array& gap_nbytes,
                           int64_t block, int num_threads) {
  if (fd < 0) throw std::invalid_argument("load_known_table: bad file descriptor");
  const auto addr = spans_to_addresses(base, size, offsets, nbytes, block, "load_known_table");
  const auto gaps = spans_to_addresses(base, size, gap_offsets, gap_nbytes, 1, "load_known_table gaps");
  std::vector<MetadataItem> want, md;
  for (const auto& kv : fixed) want.push_back({kv.first, kv.second});
  const KnownLoad r = io_without_gil([&] {
    return flashrt::load_known_table(fd, keys, want, addr.data(), nbytes.data(), nbytes.shape(0),
                                     gaps.data(), gap_nbytes.data(), gap_nbytes.shape(0), block,
                                     num_threads, &md);
  });
  static const char* const names[] = {"loaded", "not_fast", "short", "mismatch"};
  if (r == KnownLoad::kNotFast) return py::make_tuple(names[1], py::none());
  py::dict d;
  for (const MetadataItem& m : md) d[py::str(m.key)] = py::str(m.value);
  return py::make_tuple(names[static_cast<int>(r)], d);
}

}  // namespace launch
}  // namespace flashrt
