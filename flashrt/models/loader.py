"""Loading a Hugging Face-format checkpoint directory into one of our model files.

No transformers model class runs here: config.json picks the model file by model_type,
safetensors tensors are mapped by name onto a meta-device build and assigned in place.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from flashrt.core.arena import zeroed_block
from flashrt.errors import ConfigError, WeightError
from flashrt.nn.linear import (INT8_K_MULTIPLE, WEIGHT_FORMATS, Int8Embedding, Int8Weight, Linear,
                               LinearPack, pack_linears, quantize_int8, select_linear_kernel)
from .registry import model_module
from .tokenizer import load_tokenizer

_DEVICE_DTYPES = {"cpu": (torch.float32, torch.bfloat16),
                  "cuda": (torch.float32, torch.bfloat16, torch.float16)}
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """What sessions share: weights, config, tokenizer, identity. Sessions own everything else."""
    path: Path
    net: torch.nn.Module
    model_type: str
    hf_config: dict
    dtype: torch.dtype
    device: torch.device
    tokenizer: object
    eos_ids: tuple
    fingerprint: dict          # fingerprint(): model_type, config, weights, dtype (layout: the arena's)
    info: dict                 # flashrt_checkpoint.json when present (random-weight marker)
    linear_kernel: str = "aten"   # matmul path of every projection (layers.select_linear_kernel)
    weights: str = "float"        # weight format (nn.linear.WEIGHT_FORMATS); int8: projections + head

    @property
    def random_weights(self) -> bool:
        return bool(self.info.get("random_weights"))


def resolve_dtype(dtype, device: torch.device, config_dtype: str | None) -> torch.dtype:
    if dtype is None:   # fp32 on CPU: without AVX512-BF16/AMX, bf16 matmuls are emulated and slow
        return torch.float32 if device.type == "cpu" else _DTYPE_NAMES.get(config_dtype, torch.bfloat16)
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)}")
        dtype = _DTYPE_NAMES[dtype]
    if dtype not in _DEVICE_DTYPES.get(device.type, ()):
        raise ValueError(f"dtype {dtype} is not supported on {device.type}; "
                         f"supported: {[str(d) for d in _DEVICE_DTYPES.get(device.type, ())]}")
    return dtype


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise WeightError(f"{path}: shard(s) listed in the index are missing: {missing}")
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise WeightError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _eos_ids(path: Path, cfg: dict) -> tuple:
    gen = path / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    if eos is None:
        eos = cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def load_model(path, device="cpu", dtype=None, linear_kernel: str = "auto",
               weights: str = "float") -> LoadedModel:
    """weights: "float" (in dtype) or "int8" (CPU): the projections and the vocabulary head as
    per-row symmetric int8 (nn.linear.quantize_int8, int8_names), run by nn.linear.int8_linear;
    everything else in dtype. An int8 model is another fingerprint (its "weights" field), so
    capsules do not cross formats."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r}: expected one of {list(WEIGHT_FORMATS)}")
    if weights == "int8" and torch.device(device).type != "cpu":
        raise ValueError(f"weights 'int8' runs on the CPU (torch's int8 weight-only kernel), "
                         f"not on {torch.device(device).type}")
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but torch has no CUDA device")
    hf = json.loads((path / "config.json").read_text())
    mod = model_module(hf)
    config = mod.CONFIG.from_hf(hf)
    dtype = resolve_dtype(dtype, device, hf.get("torch_dtype") or hf.get("dtype"))
    with torch.device("meta"):
        net = mod.Model(config)
    digest = assign_weights(net, path, device, dtype, weights)
    net.eval()
    kernel = select_linear_kernel(net, device, dtype, linear_kernel)
    pack_linears(net)       # after the kernel: packs only where the small-M kernel runs
    gather_weights(net)     # after the packs: they are the tensors a step streams
    info_file = path / "flashrt_checkpoint.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    return LoadedModel(path, net, net.model_type, hf, dtype, device,
                       load_tokenizer(path, config.vocab_size), _eos_ids(path, hf),
                       fingerprint(net, dtype, digest, weights), info, kernel, weights)


WEIGHT_ALIGN = 64   # bytes between storages in the weight block: a cache line, any dtype's multiple


def gather_weights(net) -> int:
    """Every CPU storage of `net`'s weights (parameters, buffers, int8 scales, LinearPacks'
    tensors) moved into one core.arena.zeroed_block, in module order, each tensor keeping its
    object, offset and strides (views stay views); returns the block's bytes, 0 on another
    device. On Linux the block is on huge pages (zeroed_block says why). One storage at a time:
    the old is freed as the next is copied."""
    tensors = []
    for m in net.modules():
        tensors += [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        tensors += [t.scale for t in m._parameters.values() if isinstance(t, Int8Weight)]
        if isinstance(m, LinearPack) and m.packed is not None:
            tensors += m.tensors()
    by_storage: dict[int, list] = {}
    for t in tensors:
        if t.device.type == "cpu" and not t.is_meta:
            group = by_storage.setdefault(t.untyped_storage().data_ptr(), [])
            if all(u is not t for u in group):
                group.append(t)
    sizes = {k: ts[0].untyped_storage().nbytes() for k, ts in by_storage.items()}
    offsets, total = {}, 0
    for k, n in sizes.items():
        offsets[k], total = total, total + -(-n // WEIGHT_ALIGN) * WEIGHT_ALIGN
    if not total:
        return 0
    block = zeroed_block(total, torch.device("cpu"))
    storage, base = block.untyped_storage(), block.storage_offset()
    with torch.no_grad():
        for k, ts in by_storage.items():
            old = torch.empty(0, dtype=torch.uint8).set_(ts[0].untyped_storage())
            block[offsets[k]:offsets[k] + sizes[k]].copy_(old)
            for t in ts:      # byte offset -> elements of t's dtype (WEIGHT_ALIGN divides it)
                t.set_(storage, (base + offsets[k]) // t.element_size() + t.storage_offset(),
                       t.size(), t.stride())
            del old
    for m in net.modules():
        if isinstance(m, LinearPack) and m.packed is not None:
            m.remember_views()
    return total


def int8_names(net) -> set:
    """What weights="int8" quantizes: every Linear's weight whose input width the int8 kernel
    takes (a multiple of INT8_K_MULTIPLE), and the token table when the vocabulary head is tied
    to it (the head streams it every step; an untied table is only looked up: it stays in dtype)."""
    names = {f"{n}.weight" for n, m in net.named_modules()
             if isinstance(m, Linear) and m.in_features % INT8_K_MULTIPLE == 0}
    if getattr(net.config, "tie_word_embeddings", False) and hasattr(net, "embed_tokens") \
            and net.config.hidden_size % INT8_K_MULTIPLE == 0:
        names.add("embed_tokens.weight")
    return names


def assign_weights(net, path: Path, device, dtype, weights: str = "float") -> str:
    """The safetensors of checkpoint directory `path` onto `net`, a meta-device build: each name
    mapped by net.map_weight_name, its shape checked, cast to dtype (float32 for net.fp32_params),
    absent ones allowed by net.optional_weights; then buffers are materialised. Every loader
    (load_model, a LeRobot policy's) goes through here. weights "int8": int8_names quantized
    from the on-disk values, one tensor at a time. Returns weights_digest of the on-disk
    tensors, the fingerprint's "weights"."""
    expected = {k: v for k, v in net.state_dict().items()}
    fp32 = net.fp32_params
    to_int8 = int8_names(net) if weights == "int8" else set()
    loaded, tensors = {}, []
    for f in _weight_files(Path(path)):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                ours = net.map_weight_name(name)
                if ours is None:
                    continue
                if ours not in expected:
                    raise WeightError(f"unexpected weight {name!r} in {f.name} (no parameter {ours!r})")
                t = sf.get_tensor(name)
                if tuple(t.shape) != tuple(expected[ours].shape):
                    raise WeightError(f"weight {name!r}: shape {tuple(t.shape)} in checkpoint, "
                                      f"model expects {tuple(expected[ours].shape)}")
                tensors.append((name, t))
                want = torch.float32 if any(ours.endswith(s) for s in fp32) else dtype
                # copy=True: the model owns its weights. A tensor safetensors hands out in the
                # file's dtype is a view of the mapped file (slower to stream than owned
                # memory), and would see the file rewritten under it
                loaded[ours] = (quantize_int8(t.to(device)) if ours in to_int8
                                else t.to(device=device, dtype=want, copy=True))
    missing = sorted(set(expected) - set(loaded) - net.optional_weights(set(loaded)))
    if missing:
        raise WeightError(f"missing weight(s): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    net.on_weights_loaded(set(loaded))
    q8 = {n: loaded.pop(n) for n in [n for n, t in loaded.items() if isinstance(t, Int8Weight)]}
    net.load_state_dict(loaded, strict=False, assign=True)
    for name, q in q8.items():      # set as it is: assign would ask an int8 tensor for gradients
        owner, _, leaf = name.rpartition(".")
        setattr(net.get_submodule(owner), leaf, q)
    if "embed_tokens.weight" in q8:
        net.embed_tokens = Int8Embedding(net.embed_tokens.weight, dtype)
    still_meta = [n for n, p in net.named_parameters() if p.is_meta]
    if still_meta:   # optional weights that were absent: the model must have dropped their modules
        raise WeightError(f"parameters left without weights: {still_meta[:8]}")
    net.materialize_buffers(device)
    return weights_digest(tensors)


def fingerprint(net, dtype: torch.dtype, weights: str | None = None, fmt: str = "float") -> dict:
    """What decides whether a capsule fits a model (the layout is the arena's): its model_type,
    a digest of its config, the weights digest and the dtype. weights: assign_weights' digest of
    the on-disk tensors; None (a model built in memory, e.g. random weights) digests the
    parameters as they are, named as the model names them. fmt (the weight format) other than
    "float" is part of "weights" ("sha256:...+int8"): other weights run, other state follows."""
    if weights is None:
        weights = weights_digest([(n, t.detach().cpu()) for n, t in net.state_dict().items()])
    cfg = hashlib.sha256(json.dumps(asdict(net.config), sort_keys=True, default=str).encode())
    return {"model_type": net.model_type, "config": cfg.hexdigest()[:16],
            "weights": weights if fmt == "float" else f"{weights}+{fmt}",
            "dtype": str(dtype).replace("torch.", "")}


def weights_digest(tensors) -> str:
    """One digest of (name, tensor) pairs whatever the build (capsules made by any install of
    the same weights fit): sha256 per tensor, hashed on all cores (hashlib drops the GIL)."""
    def one(item):
        name, t = item
        raw = t.contiguous().view(-1).view(torch.uint8).numpy()
        return f"{name}:{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(raw).hexdigest()[:16]}"
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as ex:
        lines = sorted(ex.map(one, tensors))
    return "sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
