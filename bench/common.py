"""Shared helpers for the FlashRT benchmark scripts (timing, machine info, JSON, checkpoints).

Every script imports this first: it puts the repository root on sys.path (so the scripts run
from any directory against the source tree) and attaches an installed native extension when
the source tree has none built (see `attach_native`).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import platform
import site
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
RANDOM_NOTE = ("random weights: generated text is meaningless; timings and identity checks are "
               "what count")
DTYPES = ("float32", "bfloat16", "float16")


# ---- native extension ------------------------------------------------------------------------
def attach_native() -> str | None:
    """Use an installed flashrt.native._C when the source tree has no built extension.

    `python bench/x.py` imports flashrt from the source tree, where `pip install .` leaves no
    `_C` (it goes to site-packages). Without it capsule copies fall back to torch and the
    capsule checksum to a numpy XXH3 (~50 MB/s). FLASHRT_EXT_DIR may name the
    directory holding `_C*.so`; otherwise installed `flashrt/native/` directories are searched.
    Returns the path attached, or None. Must run before anything imports flashrt.native.
    """
    if "flashrt.native" in sys.modules or "flashrt.native._C" in sys.modules:
        return None
    here = ROOT / "flashrt" / "native"
    if glob.glob(str(here / "_C*.so")) or glob.glob(str(here / "_C*.pyd")):
        return None
    dirs = [os.environ["FLASHRT_EXT_DIR"]] if os.environ.get("FLASHRT_EXT_DIR") else []
    try:
        dirs += [os.path.join(p, "flashrt", "native") for p in site.getsitepackages()]
    except AttributeError:   # some virtualenvs
        pass
    dirs.append(os.path.join(site.getusersitepackages(), "flashrt", "native"))
    for d in dirs:
        for so in sorted(glob.glob(os.path.join(d, "_C*.so"))):
            spec = importlib.util.spec_from_file_location("flashrt.native._C", so)
            try:
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
            except ImportError:
                continue
            if all(hasattr(mod, n) for n in _native_needs()):
                sys.modules["flashrt.native._C"] = mod    # `from . import _C` finds it there
                return so
    return None


def _native_needs() -> tuple:
    """flashrt.native._ext.NEEDS (what it calls in the extension), read from its source:
    importing that module would bind it to the source tree's missing extension."""
    import ast
    tree = ast.parse((ROOT / "flashrt" / "native" / "_ext.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NEEDS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("flashrt/native/_ext.py defines no NEEDS")


_NATIVE_FROM = attach_native()


def native_status() -> str:
    import flashrt.native as n
    s = n.ext_status()
    return s + (f" (attached from {_NATIVE_FROM})" if _NATIVE_FROM else "")


def have_native() -> bool:
    import flashrt.native as n
    return n.HAVE_EXT


# ---- arguments -------------------------------------------------------------------------------
def base_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description + f" ({RANDOM_NOTE}.)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or auto (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weights/activations dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--quick", action="store_true", help="CI-sized smoke run (tiny sizes, 1 repeat)")
    p.add_argument("--repeats", "-n", type=int, default=None, help="timed repeats per case")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs before timing")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<name>.json)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


def setup(args) -> None:
    """Apply threads/device/dtype defaults after parsing."""
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    global _PROGRESS
    _PROGRESS = not args.no_progress


def torch_dtype(name: str):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


_PROGRESS = True


def progress(it, desc: str = "", total: int | None = None):
    """tqdm over an iterable (stderr, cleared when done); plain iterable if tqdm is missing."""
    if not _PROGRESS:
        return it
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, desc=desc, total=total, leave=False, file=sys.stderr, dynamic_ncols=True)


# ---- timing ----------------------------------------------------------------------------------
def sync(device) -> None:
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@dataclass
class Stats:
    """Seconds per run: median, min, max over the timed repeats."""
    samples: list = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def ms(self, digits: int = 1) -> str:
        """'median [min-max]' in milliseconds."""
        if not self.samples:
            return "-"
        f = f"{{:.{digits}f}}"
        if len(self.samples) == 1:
            return f.format(self.median * 1e3)
        return f"{f.format(self.median * 1e3)} [{f.format(self.min * 1e3)}-{f.format(self.max * 1e3)}]"

    def to_json(self) -> dict:
        if not self.samples:        # a stage a run never reached (a failed framework turn, say)
            return {"median_ms": None, "min_ms": None, "max_ms": None, "n": 0, "samples_ms": []}
        return {"median_ms": self.median * 1e3, "min_ms": self.min * 1e3, "max_ms": self.max * 1e3,
                "n": len(self.samples), "samples_ms": [s * 1e3 for s in self.samples]}


@dataclass
class Case:
    """One timed operation. setup() runs untimed before each run; post(result) runs untimed
    right after the case's last timed run, before any other case runs (e.g. to continue
    decoding from the state that run left)."""
    fn: Callable
    setup: Callable | None = None
    post: Callable | None = None
    inner: int = 1        # calls per sample (sample = their mean): sub-millisecond cases


def time_once(fn: Callable, device, setup: Callable | None = None, inner: int = 1):
    """(seconds per call, last result) of `inner` back-to-back calls, synchronised on CUDA
    before and after."""
    if setup is not None:
        setup()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        out = fn()
    sync(device)
    return (time.perf_counter() - t0) / inner, out


def measure(cases: dict, repeats: int, warmup: int, device, desc: str = "") -> dict:
    """Time several cases side by side: each round runs every case once, so slow drift of the
    machine (other processes, heat) hits all cases alike. Returns {name: Stats}."""
    stats = {k: Stats() for k in cases}
    rounds = [(False, i) for i in range(warmup)] + [(True, i) for i in range(repeats)]
    for timed, i in progress(rounds, desc=desc):
        for name, c in cases.items():
            dt, out = time_once(c.fn, device, c.setup, c.inner)
            if timed:
                stats[name].samples.append(dt)
                if i == repeats - 1 and c.post is not None:
                    c.post(out)
    return stats


def measure_alt(cases: dict, repeats: int, warmup: int, device, desc: str = "") -> dict:
    """measure(), with the order of the cases reversed every other round: each system runs
    first in half of the rounds, so neither always follows the other's cache footprint."""
    stats = {k: Stats() for k in cases}
    names = list(cases)
    rounds = [(False, i) for i in range(warmup)] + [(True, i) for i in range(repeats)]
    for r, (timed, _) in enumerate(progress(rounds, desc=desc)):
        for name in (names if r % 2 == 0 else names[::-1]):
            c = cases[name]
            dt, out = time_once(c.fn, device, c.setup, c.inner)
            if timed:
                stats[name].samples.append(dt)
                if c.post is not None:
                    c.post(out)
    return stats


def cached_checkpoint(model_type: str, size: str, chat: bool = False) -> Path:
    """The seed-0 random-weight checkpoint of a model_type at a size, made once and cached in
    ~/.cache/flashrt/checkpoints (an atomic rename, so racing processes agree). chat: with
    make_checkpoint's chat tokenizer and the released template (same weights), in
    <model_type>-<size>-seed0-chat."""
    import os
    import shutil
    import tempfile
    from flashrt.models import make_checkpoint
    d = Path.home() / ".cache" / "flashrt" / "checkpoints" / f"{model_type}-{size}-seed0{'-chat' if chat else ''}"
    if not (d / "flashrt_checkpoint.json").exists():
        print(f"making random-weight checkpoint {model_type}/{size}{' (chat)' if chat else ''} (once; cached "
              f"in {d.parent}) ...", flush=True)
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=d.parent))      # same filesystem: the rename is atomic
        make_checkpoint(model_type, size, tmp / "p", seed=0, chat=chat)
        try:
            os.replace(tmp / "p", d)
        except OSError:                                  # another process won the race
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def ratio(a: Stats | float | None, b: Stats | float | None) -> float | None:
    """Median ratio a/b (None when either side is missing)."""
    a = a.median if isinstance(a, Stats) else a
    b = b.median if isinstance(b, Stats) else b
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_ratio(r: float | None, digits: int = 2) -> str:
    return "-" if r is None else f"{r:.{digits}f}x"


def fmt_bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{int(n)} B"


# ---- tables ------------------------------------------------------------------------------------
@dataclass
class Table:
    title: str
    headers: list
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def add(self, *row) -> None:
        self.rows.append([str(c) for c in row])

    def text(self) -> str:
        cols = list(zip(*([self.headers] + self.rows))) if self.rows else [[h] for h in self.headers]
        w = [max(len(str(c)) for c in col) for col in cols]
        line = lambda r: "  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip()  # noqa: E731
        out = [self.title, line(self.headers), line(["-" * x for x in w])]
        out += [line(r) for r in self.rows] + [f"  {n}" for n in self.notes]
        return "\n".join(out)

    def markdown(self) -> str:
        esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
        out = [f"**{self.title}**", "", "| " + " | ".join(esc(h) for h in self.headers) + " |",
               "|" + "|".join("---" for _ in self.headers) + "|"]
        out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in self.rows]
        if self.notes:
            out += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(out)

    def to_json(self) -> dict:
        return {"title": self.title, "headers": self.headers, "rows": self.rows, "notes": self.notes}

    @staticmethod
    def from_json(d: dict) -> "Table":
        return Table(d["title"], d["headers"], d["rows"], d.get("notes", []))


# ---- machine info and results ------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
                                  if f in flags)
    except OSError:
        pass
    return []


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(device: str, dtype: str) -> dict:
    import torch
    info = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "cpu_flags": cpu_flags(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "device": device, "dtype": dtype,
            "flashrt_commit": git_commit(), "native": native_status(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if str(device).startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def banner(name: str, args, timed: bool = True) -> dict:
    """Print what is being measured and on what; returns machine info for the JSON."""
    info = machine_info(args.device, args.dtype)
    print(f"== flashrt bench {name} ({RANDOM_NOTE}) ==")
    extra = f", {info['gpu']}" if "gpu" in info else ""
    print(f"machine: {info['cpu']} x{info['cpu_count']} ({' '.join(info['cpu_flags'])}), "
          f"torch {info['torch']} threads={info['torch_threads']}, device {args.device}{extra}, "
          f"dtype {args.dtype}, commit {info['flashrt_commit']}")
    print(f"native: {info['native']}")
    if timed:
        print("timings: median [min-max] over repeats, measured side by side in this run; other "
              "processes on the machine make them noisy")
    return info


def result_path(name: str, args) -> Path:
    """bench/results/<name>[-<device>][-<dtype>][.quick].json unless --out is given.
    The default device/dtype (cpu float32) add no suffix; --quick runs never clobber full ones."""
    if args.out:
        return Path(args.out)
    dev = args.device.split(":")[0]
    default_dtype = "bfloat16" if dev == "cuda" else "float32"
    stem = name + ("" if dev == "cpu" else f"-{dev}") + ("" if args.dtype == default_dtype
                                                         else f"-{args.dtype}")
    return RESULTS / (stem + (".quick" if args.quick else "") + ".json")


def write_json(name: str, args, info: dict, tables: list, data: dict, argv,
               script: str | None = None) -> Path:
    """script: bench/<script>.py when the result's name is not the script's (default: name)."""
    path = result_path(name, args)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"bench": name, "note": RANDOM_NOTE, "command": command_line(script or name, argv),
               "quick": bool(args.quick), "machine": info,
               "tables": [t.to_json() for t in tables], "data": data}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path


def command_line(name: str, argv) -> str:
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", f"bench/{name}.py"] + args)


def _json_default(o):
    if isinstance(o, Stats):
        return o.to_json()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def save_figure(fig, path: Path) -> None:
    """Lay out, write (110 dpi, folders made) and close a matplotlib figure."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def print_tables(tables: list) -> None:
    for t in tables:
        print()
        print(t.text())


# ---- checkpoints and models ----------------------------------------------------------------------
ARCHS = ("qwen3", "qwen3_5", "lfm2")
REAL_NAMES = {"qwen3": "Qwen3-0.6B", "qwen3_5": "Qwen3.5-0.8B", "lfm2": "LFM2-350M"}


def label(arch: str, size: str) -> str:
    return f"{arch}/{REAL_NAMES[arch]} shape" if size == "real" else f"{arch}/{size}"


def checkpoint(arch: str, size: str) -> Path:
    """The cached seed-0 random-weight checkpoint (~/.cache/flashrt/checkpoints), made on first use."""
    from flashrt.models.checkpoint import default_checkpoint
    from flashrt.models.checkpoint import _norm_arch_size
    arch, size = _norm_arch_size(arch, size)
    root = Path.home() / ".cache" / "flashrt" / "checkpoints" / f"{arch}-{size}-seed0"
    if not (root / "flashrt_checkpoint.json").exists():
        print(f"making random-weight checkpoint {arch}/{size} (once; cached in {root.parent}) ...",
              flush=True)
    return Path(default_checkpoint(arch, size))


def short_path(p) -> str:
    """A path with the home directory written as ~ (results do not carry user names)."""
    s, home = str(p), str(Path.home())
    return "~" + s[len(home):] if s.startswith(home + os.sep) else s


def arch_available(arch: str) -> bool:
    return importlib.util.find_spec(f"flashrt.models.{arch}") is not None


def load_flashrt(path, args, max_seq_len: int, **kw):
    import flashrt
    return flashrt.load(path, device=args.device, dtype=args.dtype, max_seq_len=max_seq_len, **kw)


def load_hf(path, args, attn: str | None = None):
    """transformers' own eager (not compiled) model for the checkpoint, same dtype and device."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("model_type") == "qwen3_5":
        cls = transformers.Qwen3_5ForConditionalGeneration
    else:
        cls = transformers.AutoModelForCausalLM
    kw = {"attn_implementation": attn} if attn else {}
    m = cls.from_pretrained(str(path), dtype=torch_dtype(args.dtype), **kw)
    return m.to(args.device).eval()


def hf_attn_name(model) -> str:
    return str(getattr(model.config, "_attn_implementation", None) or "default")


def random_ids(n: int, vocab: int, seed: int) -> list:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def free_memory() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- transformers prefill / decode (shared by models.py and ttft.py) ------------------------------
def hf_forward(model, ids, device, cache=None):
    """One forward over ids with logits for the last position only; returns (logits[V] fp32, cache)."""
    import torch
    x = torch.tensor([ids], dtype=torch.long, device=device)
    kw = {_cache_kw(model): cache} if cache is not None else {}
    with torch.no_grad():
        out = model(input_ids=x, use_cache=True, logits_to_keep=1, **kw)
    new = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
    return out.logits[0, -1].float(), new


def _cache_kw(model) -> str:
    """transformers >= 5.2x names the cache argument `cache`; earlier 5.x (5.17 on the GPU image)
    `past_key_values`. Read per call: ~20 us against a forward's milliseconds."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_greedy(model, logits, cache, n: int, device) -> tuple[list, list]:
    """Greedy tokens starting from `logits`, decoding with the cache: (tokens, per-step logits)."""
    toks, steps = [], [logits]
    for i in range(n):
        t = int(logits.argmax())
        toks.append(t)
        if i + 1 < n:
            logits, cache = hf_forward(model, [t], device, cache)
            steps.append(logits)
    return toks, steps


def rt_greedy(rt, logits, n: int) -> tuple[list, list]:
    """Greedy tokens from flashrt `logits` (the last position), decoding n-1 more steps."""
    toks, steps = [], [logits]
    for i in range(n):
        t = int(logits.argmax())
        toks.append(t)
        if i + 1 < n:
            logits = rt.decode(t)
            steps.append(logits)
    return toks, steps
