"""The only importer of the compiled extension `flashrt.native._C`: whether it loaded, what it
was built with, and whether its OpenMP threads are torch's. Every other native module reads
these flags at call time (tests switch a path off by setting them here)."""
from __future__ import annotations

import ctypes
import functools
import os
import warnings

import torch


# What this module calls in the extension; a build from older sources lacks some, and is
# then not used (the bench scripts attach an installed build only if it has them all).
NEEDS = ("copy_segments_cpu", "xxh64", "xxh3_parts", "xxh3_isa", "zero_spans",
         "hash_blocks", "read_blocks_hashed", "load_known_table", "openmp_runtime", "CpuCopyPlan",
         "has_cuda", "version", "small_m_linear_isa", "small_m_linear_weight_dtypes")

try:
    from . import _C as C
    _missing = [n for n in NEEDS if not hasattr(C, n)]
    if _missing:
        raise ImportError(f"flashrt.native._C {getattr(C, 'version', '?')} was built from older sources "
                          f"(it lacks {', '.join(_missing)}): rebuild it (pip install .)")
    _IMPORT_ERROR: ImportError | None = None
except ImportError as _e:  # not built, built for another Python/platform, or stale
    C = None
    _IMPORT_ERROR = _e

HAVE_EXT: bool = C is not None
HAVE_CUDA_EXT: bool = HAVE_EXT and bool(C.has_cuda())


def _torch_openmp_runtime() -> str | None:
    """Path of the OpenMP runtime torch's CPU kernels call (what omp_get_max_threads resolves to
    from libtorch_cpu), or None when it cannot be told (no such library, no dladdr)."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(lib):
        return None

    class _DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]
    try:
        # already loaded by `import torch`: RTLD_NOLOAD only looks it up; dlsym on its handle
        # searches it and its dependencies, as its own calls resolve
        fn = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_get_max_threads
        info = _DlInfo()
        if not ctypes.CDLL(None).dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)):
            return None
    except (OSError, AttributeError):
        return None
    return os.fsdecode(info.dli_fname) if info.dli_fname else None


def _copies_on_torch_threads() -> bool:
    """Whether the extension's parallel CPU copy runs on torch's own intra-op threads: it was
    built with OpenMP and bound to the runtime torch calls (loaded first, same soname).
    Otherwise its threads would compete with torch's spinning ones, and large copies go
    through torch instead (see SegmentPlan)."""
    if not HAVE_EXT or not C.openmp_runtime():
        return False
    theirs = _torch_openmp_runtime()
    return theirs is not None and os.path.realpath(theirs) == os.path.realpath(C.openmp_runtime())


COPIES_ON_TORCH_THREADS: bool = _copies_on_torch_threads()


def cpu_kernel_runs(name: str = "") -> bool:
    """Whether an AVX2 CPU kernel of the extension runs here: built (x86-64), the CPU has AVX2 +
    FMA, its threads are torch's, and the build has `name` (older sources lack the newer ones)."""
    return (HAVE_EXT and bool(C.small_m_linear_isa()) and COPIES_ON_TORCH_THREADS
            and (not name or hasattr(C, name)))


def check_tensor(fn: str, name: str, t: torch.Tensor, dtypes: tuple, dim: int = 2) -> None:
    """ValueError naming argument `name` of `fn` unless t is a contiguous `dim`-D CPU tensor of one
    of `dtypes`: what the wrappers check before handing an address to the extension."""
    if t.dtype not in dtypes or t.dim() != dim or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} must be a contiguous {dim}-D "
                         f"{' or '.join(str(d)[6:] for d in dtypes)} CPU tensor, got "
                         f"{t.dtype}, shape {tuple(t.shape)}, strides {t.stride()}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}, {t.device}")


def ext_status() -> str:
    """One line saying which native paths are in use (for logs and bug reports)."""
    if not HAVE_EXT:
        return (f"flashrt.native._C unavailable ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}); "
                "using torch copies and Python/numpy hashing")
    cuda = "CUDA segmented copy" if C.has_cuda() else "no CUDA kernel (built without CUDA)"
    threads = ("torch's OpenMP threads" if COPIES_ON_TORCH_THREADS else
               f"OpenMP at {C.openmp_runtime()}, not torch's" if C.openmp_runtime() else
               "own thread pool")
    small_m = bool(C.small_m_linear_isa()) and COPIES_ON_TORCH_THREADS     # gemm.SMALL_M_LINEAR
    lin = (f"small-M linear, GDN rule and conv, one-query attention, RMSNorm, silu*mul "
           f"({C.small_m_linear_isa()})" if small_m else
           "no small-M linear" + ("" if C.small_m_linear_isa() else " (needs x86-64 AVX2 + FMA)"))
    return (f"flashrt.native._C {C.version}: CPU segmented copy ({threads}), xxh64, xxh3 "
            f"({C.xxh3_isa()}), block checksums, {lin}, {cuda}")


@functools.lru_cache(maxsize=None)
def warn_fallback() -> None:
    # lru_cache makes this fire once per process without a mutable flag.
    warnings.warn(f"{ext_status()}; native copies and hashing will be slower",
                  RuntimeWarning, stacklevel=3)

