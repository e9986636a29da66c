"""Convert flashrt's random-weight checkpoints to GGUF for the llama.cpp column of bench/ttft.py.

llama.cpp's own converter (vendor/llama.cpp/convert_hf_to_gguf.py in llama-cpp-python's source
tarball) does the conversion; this script only prepares what it needs and never edits it:

* a staging directory with links to the checkpoint's config and safetensors files, plus a
  byte-level BPE tokenizer (256 byte tokens, 3 merges) written with the `tokenizers` library:
  the converter insists on a tokenizer, and pads the vocabulary to the config's vocab_size with
  unused tokens, so token ids are the model's ids and the bench feeds ids directly;
* the converter refuses BPE pre-tokenizers whose hash it does not know; ours is plain
  byte-level, which llama.cpp calls "gpt-2", so the converter runs with that answer patched in
  (in the child process only);
* Qwen3.5: `--no-mtp`, so llama.cpp runs the plain model (the MTP layer is a draft head).

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    python bench/gguf.py --llama-src llama_cpp_python-0.3.36          # default models, float32
    python bench/ttft.py                                               # finds them in the cache

    python bench/gguf.py --llama-src ... --models qwen3_5:real --dtype float32 bfloat16 q8_0   # decode.py

Output: ~/.cache/flashrt/gguf/<arch>-<size>-<dtype>.gguf (the name ttft.py and decode.py look for).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

# q8_0: llama.cpp's 8-bit type (blocks of 32 int8 weights with one fp16 scale: 8.5 bits a
# weight), the one bench/decode.py sets against flashrt's int8 weights
OUTTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "q8_0": "q8_0"}

# Run in a child process: patch the pre-tokenizer answer, then hand argv to the converter.
_RUNNER = """
import runpy, sys
from pathlib import Path
conv = Path(sys.argv[1])
sys.path[:0] = [str(conv.parent), str(conv.parent / "gguf-py")]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [str(conv)] + sys.argv[2:]
runpy.run_path(str(conv), run_name="__main__")
"""


def gguf_path(arch: str, size: str, dtype: str, cache_dir: Path | None = None) -> Path:
    base = cache_dir or Path.home() / ".cache" / "flashrt" / "gguf"
    return base / f"{arch}-{size}-{dtype}.gguf"


def find_converter(src: Path) -> Path:
    for cand in (src / "convert_hf_to_gguf.py", src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"no convert_hf_to_gguf.py under {src} (give llama-cpp-python's unpacked "
                            "source tarball or a llama.cpp checkout)")


def write_byte_tokenizer(out: Path, eos_id: int | None) -> None:
    """A byte-level BPE tokenizer: the 256 byte symbols (ids 0-255) and three merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    # llama.cpp refuses a BPE vocabulary without merges: three real ones (ids 256-258)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token_id"] = eos_id        # informative; the model's config carries the real ids
    cfg_path.write_text(json.dumps(cfg, indent=1))


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def stage(ckpt: Path, out: Path) -> None:
    """Links to the checkpoint's files; the byte tokenizer is written unless it has one."""
    for f in ckpt.iterdir():
        if f.suffix in (".json", ".safetensors") and f.name != "flashrt_checkpoint.json":
            (out / f.name).symlink_to(f.resolve())
    if not (ckpt / "tokenizer.json").exists():
        eos = _text_config(json.loads((ckpt / "config.json").read_text())).get("eos_token_id")
        write_byte_tokenizer(out, eos[0] if isinstance(eos, list) else eos)


def convert(arch: str, size: str, dtype: str, llama_src: Path, out: Path | None = None,
            force: bool = False) -> Path:
    return convert_dir(C.checkpoint(arch, size), arch, dtype, llama_src,
                       out or gguf_path(arch, size, dtype), force)


def convert_dir(ckpt: Path, arch: str, dtype: str, llama_src: Path, out: Path, force: bool = False) -> Path:
    """Any checkpoint directory of `arch` -> GGUF at `out` (kept if it exists, unless force)."""
    if out.exists() and not force:
        print(f"{out}: exists (use --force to redo)")
        return out
    conv = find_converter(llama_src)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"flashrt-gguf-{arch}-") as tmp:
        stage(ckpt, Path(tmp))
        cmd = [sys.executable, "-c", _RUNNER, str(conv), tmp, "--outtype", OUTTYPE[dtype],
               "--outfile", str(out) + ".part"]
        if arch == "qwen3_5":
            cmd.append("--no-mtp")
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf failed for {C.short_path(ckpt)} ({dtype}):\n"
                               + "\n".join((r.stdout + r.stderr).splitlines()[-25:]))
    Path(str(out) + ".part").replace(out)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB from {C.short_path(ckpt)}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser("bench/gguf.py", description=__doc__.split("\n")[0])
    p.add_argument("--llama-src", type=Path, required=True,
                   help="unpacked llama-cpp-python source tarball or llama.cpp checkout")
    p.add_argument("--models", default="qwen3_5:real,qwen3:small,lfm2:small",
                   help="comma list of arch:size (default: ttft.py's CPU models)")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=sorted(OUTTYPE),
                   help="weight types of the GGUFs (q8_0: llama.cpp's 8-bit blocks; default float32)")
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    failed = []
    for m in a.models.split(","):
        arch, size = m.split(":")
        for dtype in a.dtype:
            try:
                convert(arch, size, dtype, a.llama_src, force=a.force)
            except (RuntimeError, FileNotFoundError) as e:
                print(e)
                failed.append(f"{m} {dtype}")
    if failed:
        print(f"not converted: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
