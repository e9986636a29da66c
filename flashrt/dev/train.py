"""Train the default model: a small Qwen3.5-shaped hybrid on the running interpreter's stdlib.

    python -m flashrt.dev.train --out DIR     # seeded; 15 min on the shared 2-core machine (1 thread)

Corpus: every *.py under sysconfig.get_paths()["stdlib"] (site-packages excluded), sorted by
path; every `--val-every`-th file is held out. Tokenizer: byte-level BPE trained on the
training files with `tokenizers`. Trunk: transformers' Qwen3_5ForCausalLM (Gated DeltaNet +
gated attention). MTP: our module below, trained jointly to predict the token after next,
saved under the released names `mtp.*` exactly as flashrt/models/qwen3_5.py `Model.draft` consumes it.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")   # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---- corpus and tokenizer -----------------------------------------------------------------
def corpus_files(root: str | None = None) -> list[pathlib.Path]:
    """The stdlib's *.py files in sorted path order (site-packages is not the stdlib)."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if "site-packages" not in p.relative_to(root).parts and p.is_file())


def read_texts(files) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    """All documents, each followed by <|endoftext|> (id 0), as one int64 stream."""
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int64)


def save_tokenizer(tok, out: pathlib.Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
           "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "unk_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
           "additional_special_tokens": list(SPECIALS), "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ---- model --------------------------------------------------------------------------------
def text_config(a, vocab: int):
    from transformers import Qwen3_5TextConfig
    every = a.full_attention_every
    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(a.layers)]
    half = int(a.head_dim * 0.25) // 2                 # partial rotary 0.25: mrope halves sum to it
    sec = [half - 2 * (half // 3), half // 3, half // 3]
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, layer_types=types, full_attention_interval=every,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        attn_output_gate=True, linear_num_key_heads=a.linear_k_heads,
        linear_num_value_heads=a.linear_v_heads, linear_key_head_dim=a.linear_head_dim,
        linear_value_head_dim=a.linear_head_dim, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": sec},
        bos_token_id=0, eos_token_id=0, pad_token_id=0, mtp_num_hidden_layers=1,
        architectures=["Qwen3_5ForCausalLM"])


class MTPHead(nn.Module):
    """fc([norm(embed(t_{p+1})), norm(h_p)]) -> one full-attention decoder layer -> norm; the
    tied LM head on top predicts t_{p+2}. Names match the released checkpoint's `mtp.*`."""

    def __init__(self, cfg):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(cfg, cfg.layer_types.index("full_attention"))])
        self.norm = Qwen3_5RMSNorm(h, eps)

    def forward(self, emb_next, hidden, rotary):
        """emb_next, hidden: (B, T, h) = embed(t_{p+1}), main hidden at p; rope position p."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(hidden)], -1))
        pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        cos_sin = rotary(x, pos[None].expand(3, -1, -1))
        return self.norm(self.layers[0](x, position_embeddings=cos_sin))


class Trainee(nn.Module):
    def __init__(self, cfg):
        from transformers import Qwen3_5ForCausalLM
        super().__init__()
        self.lm = Qwen3_5ForCausalLM(cfg)
        self.mtp = MTPHead(cfg)
        with torch.no_grad():                         # zero-centred norms: (1 + w), w = 0
            for n, p in self.mtp.named_parameters():
                if "norm" in n:
                    p.zero_()
                elif p.dim() == 2:
                    p.normal_(0.0, cfg.initializer_range)

    def losses(self, ids: torch.Tensor):
        """ids (B, T): main next-token loss over T-1 positions, MTP (token after next) over T-2."""
        m = self.lm.model
        h = m(input_ids=ids).last_hidden_state                 # (B, T, h), after the final norm
        head = self.lm.lm_head
        main = F.cross_entropy(head(h[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
        g = self.mtp(m.embed_tokens(ids[:, 1:-1]), h[:, :-2], m.rotary_emb)
        mtp = F.cross_entropy(head(g).flatten(0, 1).float(), ids[:, 2:].flatten())
        return main, mtp


def state_dict_released(model: Trainee, dtype) -> dict:
    """Trunk under transformers' names (tied head stored once), MTP under `mtp.*`."""
    sd = {k: v for k, v in model.lm.state_dict().items() if k != "lm_head.weight"}
    sd.update({f"mtp.{k}": v for k, v in model.mtp.state_dict().items()})
    return {k: v.detach().to(dtype).contiguous() for k, v in sd.items()}


# ---- training -----------------------------------------------------------------------------
def batches(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    starts = torch.randint(0, stream.numel() - seq, (batch,), generator=gen)
    return torch.stack([stream[s: s + seq] for s in starts.tolist()])


def val_windows(stream: torch.Tensor, seq: int, n: int) -> torch.Tensor:
    """n evenly spaced, non-overlapping windows of the held-out stream (deterministic)."""
    step = max(seq, (stream.numel() - seq) // n)
    return torch.stack([stream[i * step: i * step + seq] for i in range(n)
                        if i * step + seq <= stream.numel()])


@torch.no_grad()
def evaluate(model: Trainee, windows: torch.Tensor, batch: int, autocast: bool) -> tuple[float, float]:
    model.eval()
    tot = [0.0, 0.0]
    for i in range(0, windows.shape[0], batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            main, mtp = model.losses(windows[i: i + batch])
        n = windows[i: i + batch].shape[0]
        tot[0] += main.item() * n
        tot[1] += mtp.item() * n
    model.train()
    return tot[0] / windows.shape[0], tot[1] / windows.shape[0]


def lr_at(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashrt.dev.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stdlib", default=None, help="corpus root (default: this interpreter's stdlib)")
    p.add_argument("--val-every", type=int, default=20, help="hold out every n-th file")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=640)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--full-attention-every", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--linear-k-heads", type=int, default=2)
    p.add_argument("--linear-v-heads", type=int, default=4)
    p.add_argument("--linear-head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.5, help="loss = main + w * mtp")
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 beat 2 on the shared 2-core machine (OpenMP spin-waits)")
    p.add_argument("--bf16-autocast", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast, fp32 master weights (faster than fp32 on AVX512-BF16 CPUs)")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    files = corpus_files(a.stdlib)
    val_files = files[::a.val_every]
    train_files = [f for i, f in enumerate(files) if i % a.val_every]
    train_texts, val_texts = read_texts(train_files), read_texts(val_files)
    tok = train_tokenizer(train_texts, a.vocab)
    train_ids, val_ids = encode(tok, train_texts), encode(tok, val_texts)
    t_data = time.perf_counter() - t_start
    print(f"corpus: {len(files)} files, {sum(map(len, train_texts)) / 1e6:.1f}M chars train / "
          f"{sum(map(len, val_texts)) / 1e6:.1f}M held out; {train_ids.numel() / 1e6:.2f}M / "
          f"{val_ids.numel() / 1e6:.2f}M tokens (vocab {tok.get_vocab_size()}); {t_data:.0f} s", flush=True)

    cfg = text_config(a, tok.get_vocab_size())
    model = Trainee(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.lm.model.embed_tokens.weight.numel()
    print(f"model: {n_params / 1e6:.2f}M params ({n_embed / 1e6:.2f}M embedding, tied); "
          f"layers {cfg.layer_types} + 1 MTP layer", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(a.seed)
    windows = val_windows(val_ids, a.seq, a.val_windows)
    log, t_train = [], time.perf_counter()
    for step in range(a.steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, a)
        x = batches(train_ids, a.batch, a.seq, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16_autocast):
            main_l, mtp_l = model.losses(x)
        loss = main_l + a.mtp_weight * mtp_l
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        entry = {"step": step + 1, "train_main": round(main_l.item(), 4),
                 "train_mtp": round(mtp_l.item(), 4), "s": round(time.perf_counter() - t_train, 1)}
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            vm, vt = evaluate(model, windows, a.batch, a.bf16_autocast)
            entry.update(val_main=round(vm, 4), val_mtp=round(vt, 4))
        if (step + 1) % 10 == 0 or "val_main" in entry:
            print(json.dumps(entry), flush=True)
        log.append(entry)
    t_train = time.perf_counter() - t_train

    # held-out loss of what is saved (weights rounded to the saved dtype), fp32 compute
    dtype = getattr(torch, a.save_dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    val_main, val_mtp = evaluate(model, windows, a.batch, False)
    print(f"held-out loss ({windows.numel()} tokens, saved {a.save_dtype} weights, fp32): main "
          f"{val_main:.4f} nats/token (ppl {math.exp(val_main):.1f}), MTP {val_mtp:.4f}", flush=True)
    save(model, cfg, tok, out, dtype, {
        "random_weights": False, "trained": True, "arch": "qwen3_5", "layout": "text",
        "seed": a.seed, "dtype": a.save_dtype, "mtp": True,
        "params": n_params, "params_embedding": n_embed,
        "corpus": {"source": "Python standard library *.py (sysconfig stdlib, site-packages excluded)",
                   "python": sys.version.split()[0], "files": len(files),
                   "train_files": len(train_files), "heldout_files": len(val_files),
                   "heldout_rule": f"every {a.val_every}th file in sorted order",
                   "train_tokens": train_ids.numel(), "heldout_tokens": val_ids.numel()},
        "training": {"steps": a.steps, "batch": a.batch, "seq": a.seq,
                     "tokens_seen": a.steps * a.batch * a.seq, "lr": a.lr, "min_lr": a.min_lr,
                     "warmup": a.warmup, "schedule": "linear warmup + cosine",
                     "optimizer": "AdamW(0.9, 0.95)", "weight_decay": a.weight_decay,
                     "mtp_weight": a.mtp_weight, "bf16_autocast": a.bf16_autocast, "threads": a.threads,
                     "train_seconds": round(t_train, 1),
                     "total_seconds": round(time.perf_counter() - t_start, 1),
                     "torch": torch.__version__},
        "heldout": {"windows": int(windows.shape[0]), "tokens": int(windows.numel()),
                    "main_loss": round(val_main, 4), "mtp_loss": round(val_mtp, 4)},
        "note": "trained here by `python -m flashrt.dev.train`; a tiny model: completions of Python code are "
                "plausible-looking, not correct"})
    (out / "train_log.json").write_text(json.dumps(log) + "\n")
    print(f"wrote {out} in {time.perf_counter() - t_start:.0f} s (training {t_train:.0f} s)")
    return 0


def save(model: Trainee, cfg, tok, out: pathlib.Path, dtype, meta: dict) -> None:
    from safetensors.torch import save_file
    save_file(state_dict_released(model, dtype), out / "model.safetensors", metadata={"format": "pt"})
    cfg.dtype = dtype
    cfg.save_pretrained(out)
    cj = json.loads((out / "config.json").read_text())
    cj["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cj, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_tokenizer(tok, out)
    (out / "flashrt_checkpoint.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
