// Export layer only: argument checking lives in launchers.cpp, the work in
// the kernels. Addresses are Python ints (torch data_ptr()) so the module
// never links libtorch and is independent of the torch ABI.
#include <pybind11/pybind11.h>

#include "launchers.h"

#ifndef FLASHRT_VERSION
#define FLASHRT_VERSION "0.0.0"
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "FlashRT native kernels: segmented copy, XXH64, XXH3 and block checksums";
  m.attr("version") = FLASHRT_VERSION;
  m.def("copy_segments_cpu", &flashrt::launch::copy_segments_cpu, py::arg("src"), py::arg("dst"),
        py::arg("nbytes"), py::arg("num_threads") = 0,
        "Copy nbytes[i] bytes from address src[i] to dst[i] for all i (host memory). "
        "num_threads=0 uses all hardware threads; small copies stay on the calling thread.");
  py::class_<flashrt::launch::CpuCopyPlan>(m, "CpuCopyPlan",
        "copy_segments_cpu's table, validated and copied once; run() copies (host memory).")
      .def(py::init<const flashrt::launch::Int64Array&, const flashrt::launch::Int64Array&,
                    const flashrt::launch::Int64Array&>(),
           py::arg("src"), py::arg("dst"), py::arg("nbytes"))
      .def("run", &flashrt::launch::CpuCopyPlan::run, py::arg("num_threads") = 0)
      .def("__len__", &flashrt::launch::CpuCopyPlan::size);
#ifdef FLASHRT_WITH_CUDA
  m.def("copy_segments_cuda", &flashrt::launch::copy_segments_cuda, py::arg("src"), py::arg("dst"),
        py::arg("nbytes"), py::arg("stream"),
        "Same as copy_segments_cpu for device memory of the current device, as one kernel "
        "launch on `stream` (a cudaStream_t as int); asynchronous.");
#endif
#ifdef FLASHRT_SMALL_M_LINEAR
  m.def("small_m_linear", &flashrt::launch::small_m_linear, py::arg("x"), py::arg("w"), py::arg("y"),
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("num_threads") = 0,
        py::arg("bf16_weights") = false,
        "y (m, n) = x (m, k) @ w (n, k).T at host addresses, x and y float32, w float32 (bf16 "
        "where bf16_weights), contiguous rows; num_threads=0 uses OpenMP's thread count. For "
        "small m (a short step's projections).");
  m.def("gemv_bf16", &flashrt::launch::gemv_bf16, py::arg("x"), py::arg("w"), py::arg("y"), py::arg("n"),
        py::arg("k"), py::arg("num_threads") = 0,
        "y (n,) = x (k,) @ w (n, k).T at host addresses, all bf16, contiguous; summed in float32, "
        "y rounded to nearest even.");
  m.def("small_m_linear_int8", &flashrt::launch::small_m_linear_int8, py::arg("x"), py::arg("w"),
        py::arg("scale"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"),
        py::arg("num_threads") = 0,
        "y (m, n) = (x (m, k) @ w (n, k).T) * scale (n,) at host addresses: x and y float32, w "
        "int8, scale bf16, contiguous; num_threads=0 uses OpenMP's thread count.");
  m.def("gated_delta_rule", &flashrt::launch::gated_delta_rule, py::arg("qkv"), py::arg("qkv_stride"),
        py::arg("q_off"), py::arg("k_off"), py::arg("v_off"), py::arg("g"), py::arg("beta"),
        py::arg("state"), py::arg("out"), py::arg("planes"), py::arg("T"), py::arg("hk"),
        py::arg("hv"), py::arg("dk"), py::arg("dv"), py::arg("num_threads") = 0,
        "Gated DeltaNet's rule token by token at host addresses, float32: state (hv, dk, dv) "
        "updated in place, out (T, hv, dv), planes (T, hv, dk, dv) or 0.");
  m.def("gated_delta_step", &flashrt::launch::gated_delta_step, py::arg("qkv"), py::arg("qkv_stride"),
        py::arg("q_off"), py::arg("k_off"), py::arg("v_off"), py::arg("a"), py::arg("b"),
        py::arg("state"), py::arg("out"), py::arg("planes"), py::arg("T"), py::arg("hk"),
        py::arg("hv"), py::arg("dk"), py::arg("dv"), py::arg("a_log"), py::arg("dt_bias"),
        py::arg("z"), py::arg("norm_w"), py::arg("eps"), py::arg("round_bf16") = false,
        py::arg("bf16_io") = false, py::arg("num_threads") = 0,
        "gated_delta_rule's gated form: beta and the decay from the raw b and a projections, out "
        "(T, hv, dv) = rmsnorm(o) * norm_w * silu(z), rounded as a bf16 model's where round_bf16; "
        "bf16_io: qkv, a, b, z, norm_w and out bf16 (state, a_log, dt_bias float32).");
  m.def("decode_attention", &flashrt::launch::decode_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("L"), py::arg("hq"), py::arg("hkv"), py::arg("d"), py::arg("scale"),
        py::arg("bf16_kv") = false, py::arg("num_threads") = 0,
        "One query's attention at host addresses: out (hq, d) = softmax(scale q K^T) V per query "
        "head over L rows of (hkv, d) float32 (bf16 where bf16_kv) K/V; q, out float32.");
  m.def("rms_norm", &flashrt::launch::rms_norm, py::arg("x"), py::arg("w"), py::arg("y"), py::arg("M"),
        py::arg("D"), py::arg("eps"), py::arg("zero_centred"), py::arg("bf16_x") = false,
        py::arg("bf16_w") = false, py::arg("r") = 0, py::arg("s") = 0, py::arg("num_threads") = 0,
        "RMSNorm of M rows of D at host addresses: y = x / rms(x) * (1 + w if zero_centred else w); "
        "x, y float32 (bf16 where bf16_x, rounded as the torch form rounds), w float32 or bf16; "
        "r, s non-zero: x + r is written to s and normed instead of x.");
  m.def("causal_conv", &flashrt::launch::causal_conv, py::arg("x"), py::arg("w"), py::arg("state"),
        py::arg("planes"), py::arg("y"), py::arg("T"), py::arg("C"), py::arg("K"), py::arg("bf16") = false,
        "y (T, C) = silu(depthwise causal conv of x (T, C) with w (C, K), state (C, K-1) the left "
        "context, advanced in place) at host addresses, float32 (bf16 where bf16, rounded as its "
        "torch form rounds); planes (T, C, K-1) the state after each row, or 0.");
  m.def("silu_mul", &flashrt::launch::silu_mul, py::arg("gate"), py::arg("up"), py::arg("y"), py::arg("M"),
        py::arg("N"), py::arg("gate_stride"), py::arg("up_stride"), py::arg("bf16") = false,
        "y (M, N) = silu(gate) * up at host addresses, float32 (bf16 where bf16, rounded as the two "
        "torch ops round); gate and up rows gate_stride and up_stride elements apart.");
#endif
  m.def("small_m_linear_isa", &flashrt::launch::small_m_linear_isa,
        "'avx2-fma' where small_m_linear runs on this CPU, '' otherwise.");
  m.def("small_m_linear_weight_dtypes", &flashrt::launch::small_m_linear_weight_dtypes,
        "The weight dtypes small_m_linear takes.");
  m.def("xxh64", &flashrt::launch::xxh64, py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0,
        "XXH64 of nbytes bytes at host address ptr, as an unsigned 64-bit int.");
  m.def("xxh3_isa", &flashrt::launch::xxh3_isa,
        "The code XXH3 runs on this CPU: 'avx2' or 'baseline'.");
  m.def("xxh3_parts", &flashrt::launch::xxh3_parts, py::arg("parts"),
        "XXH3-64 (seed 0) of a list of bytes-like objects concatenated, without joining them.");
  m.def("zero_spans", &flashrt::launch::zero_spans, py::arg("base"), py::arg("size"),
        py::arg("offsets"), py::arg("nbytes"),
        "Zero the spans (offset, nbytes) of the host buffer [base, base + size).");
  m.def("hash_blocks", &flashrt::launch::hash_blocks, py::arg("base"), py::arg("size"),
        py::arg("offsets"), py::arg("nbytes"), py::arg("block"), py::arg("num_threads") = 0,
        "XXH3-64 (seed 0) of each `block`-byte block of the stream formed by the spans "
        "(offset, nbytes) of the host buffer [base, base + size), in order; the digests as "
        "little-endian u64 bytes. Blocks are hashed on up to num_threads threads (0 = all).");
  m.def("read_blocks_hashed", &flashrt::launch::read_blocks_hashed, py::arg("fd"),
        py::arg("file_offset"), py::arg("base"), py::arg("size"), py::arg("offsets"),
        py::arg("nbytes"), py::arg("block"), py::arg("num_threads") = 0,
        "Read the stream from fd at file_offset into the spans and return what hash_blocks "
        "would return for them, or None when the file ends first. OSError on a read error.");
  m.def("load_known_table", &flashrt::launch::load_known_table, py::arg("fd"), py::arg("keys"),
        py::arg("fixed"), py::arg("base"), py::arg("size"), py::arg("offsets"), py::arg("nbytes"),
        py::arg("gap_offsets"), py::arg("gap_nbytes"), py::arg("block"), py::arg("num_threads") = 0,
        "Load a capsule file whose metadata has exactly `keys`, with the (key, value) pairs "
        "`fixed` (its 'entries' the table the spans were derived from), into the spans (payload "
        "in file order) of [base, base + size), zeroing the gap spans and verifying the block "
        "checksums and the file checksum: (status, metadata dict or None), status 'loaded', "
        "'short', 'mismatch' or 'not_fast' (nothing written; read it the general way).");
  m.def("openmp_runtime", &flashrt::launch::openmp_runtime,
        "Path of the OpenMP runtime the CPU parallel copy runs on ('' = built without OpenMP: "
        "the extension's own thread pool).");
  m.def("has_cuda", [] {
#ifdef FLASHRT_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether copy_segments_cuda was compiled in.");
}
