"""Python face of the native extension `flashrt.native._C` (csrc/: kernel -> launcher that
checks -> binding that only exports -> the wrappers here).

Rule: native/ is the only importer of `_C` (in _ext.py), and every function has a fallback
that gives the same result without it (torch copies, pure-Python hashes), after one warning.
It imports nothing of flashrt outside this folder.

* copies.py: ``SegmentPlan`` / ``copy_segments``: many (src, dst) byte ranges at once, on the
  CPU's threads (torch's OpenMP threads when the extension shares torch's runtime) or one CUDA
  kernel launch on the current stream.
* hashes.py: ``xxh64``, ``xxh3``, and the capsule file checksum (``hash_blocks`` /
  ``read_blocks_hashed``: an XXH3-64 per block, each hashed right after it is read).
* capsule_file.py: ``load_known_table``, a whole capsule load in one call for a file whose
  entry table the target already holds; ``zero_spans``.
* gemm.py: ``small_m_linear`` / ``small_m_linear_int8``, the small-M projection kernel (one
  row: a GEMV) for float32, bf16 and int8 weights; ``gemv_bf16``, one row bf16 in and out.
* attention.py: ``decode_attention``, one query's attention over the KV cache (decode).
* norm.py: ``rms_norm``, RMSNorm over a step's rows; ``add_rms_norm``, with the residual add before it.
* activation.py: ``silu_mul``, SwiGLU's silu(gate) * up over a step's rows.
* recurrent.py: ``gated_delta_rule``, Gated DeltaNet's rule token by token (decode, verify);
  ``gated_delta_step``, the same with the decay, beta and output gated norm of Qwen3.5's block;
  ``causal_conv``, silu(depthwise causal conv) over a step's rows (its state advanced).
* _ext.py: loading the extension, and whether its OpenMP threads are torch's.
"""
from __future__ import annotations

from ._ext import (COPIES_ON_TORCH_THREADS, HAVE_CUDA_EXT, HAVE_EXT, NEEDS, C as _C,  # noqa: F401
                   ext_status)
from .capsule_file import load_known_table, zero_spans  # noqa: F401
from .copies import SegmentPlan, copy_segments  # noqa: F401
from .gemm import (GEMV_BF16, SMALL_M_INT8, SMALL_M_LINEAR, SMALL_M_MAX, SMALL_M_MAX_BF16,  # noqa: F401
                   SMALL_M_MAX_INT8, gemv_bf16, small_m_linear, small_m_linear_int8)
from .attention import DECODE_ATTENTION, decode_attention  # noqa: F401
from .norm import RMS_NORM, add_rms_norm, rms_norm  # noqa: F401
from .activation import SILU_MUL, silu_mul  # noqa: F401
from .recurrent import (CAUSAL_CONV, GDN_RULE, GDN_STEP, causal_conv, gated_delta_rule,  # noqa: F401
                        gated_delta_step)
from .hashes import hash_blocks, read_blocks_hashed, xxh3, xxh3_parts, xxh64  # noqa: F401

__all__ = ["HAVE_EXT", "HAVE_CUDA_EXT", "ext_status", "SegmentPlan", "copy_segments", "xxh64",
           "xxh3", "xxh3_parts", "zero_spans", "hash_blocks", "read_blocks_hashed",
           "load_known_table", "small_m_linear", "small_m_linear_int8"]
