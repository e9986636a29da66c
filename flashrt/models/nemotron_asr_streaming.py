"""Nemotron Speech Streaming (cache-aware FastConformer encoder + RNN-T): streaming ASR.

Order: config -> layers -> block -> encoder -> RNN-T prediction/joint -> model -> weight names.
One session position is one encoder frame (subsampling_factor mel frames, 80 ms). A step runs
one chunk: T = lookahead + 1 frames from 1 + 8(T-1) mel frames (the first) or 8T (later ones).
State (arena names, batch 1, every buffer fixed-size, so a capsule costs the same anywhere):
- `audio.tail` conv (float32) / `audio.pending` meta: raw samples (models/nemotron_features.py);
- `sub.{i}.conv` conv, (C_in, kernel - stride, freq + pad): the subsampling convs' last inputs;
- `layers.{i}.attn.k` / `.v` recurrent, (window - 1, heads, head_dim): the left context, oldest
  first (rows older than the frames seen so far are masked);
- `layers.{i}.conv` conv, (kernel - 1, hidden): the depthwise conv's last inputs;
- `pred.h` / `pred.c` recurrent (layers, pred_hidden), `pred.out` recurrent (pred_hidden,): the
  LSTM state and prediction output after the last emitted token (after blank at the start);
- `rnnt.last` / `rnnt.emitted` / `rnnt.symbols` meta: last token, tokens emitted, symbols at
  the current frame (0 between steps: a step decodes through its last frame).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import (BufferSpec, InputSpec, Linear, StepCtx, TranscriberModel, check,
                   depthwise_causal_conv, linear, require)
from .nemotron_features import LogMel

ACTS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}
LOOKAHEADS = (13, 6, 1, 0)      # the released right contexts (transformers' processor default)


# ---- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class NemotronAsrConfig:
    vocab_size: int
    blank_id: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    ffn_act: str
    attention_bias: bool
    conv_bias: bool
    conv_kernel: int
    subsampling_factor: int
    subsampling_channels: int
    num_mel_bins: int
    scale_input: bool
    window: int                 # sliding_window: left context + 1 frames
    pred_hidden: int
    pred_layers: int
    joint_act: str
    max_symbols: int
    lookaheads: tuple = LOOKAHEADS
    sample_rate: int = 16000    # the feature extractor's (preprocessor_config.json) defaults
    hop: int = 160

    @classmethod
    def from_hf(cls, cfg: dict) -> "NemotronAsrConfig":
        t = "nemotron_asr_streaming"
        enc = cfg.get("encoder_config") or {}
        ffn, joint = enc.get("hidden_act", "silu"), cfg.get("hidden_act", "relu")
        check(ffn in ACTS and joint in ACTS, t, "hidden_act", f"{ffn}/{joint} (supported: {sorted(ACTS)})")
        factor = enc.get("subsampling_factor", 8)
        check(factor >= 2 and factor & (factor - 1) == 0, t, "subsampling_factor", f"{factor} (a power of 2)")
        check((enc.get("subsampling_conv_kernel_size", 3), enc.get("subsampling_conv_stride", 2)) == (3, 2),
              t, "subsampling_conv_kernel_size/stride", "only kernel 3, stride 2 (the released shape)")
        heads, hidden = enc.get("num_attention_heads", 8), enc.get("hidden_size", 1024)
        check(hidden % heads == 0, t, "num_attention_heads", f"hidden {hidden} not divisible by {heads}")
        kernel = enc.get("conv_kernel_size", 9)
        check(kernel >= 2, t, "conv_kernel_size", f"{kernel} (needs >= 2)")
        vocab = require(cfg, "vocab_size", t)
        blank = cfg.get("blank_token_id", vocab - 1)
        check(0 <= blank < vocab, t, "blank_token_id", f"{blank} outside the vocabulary of {vocab}")
        window = enc.get("sliding_window", 71)
        check(window >= 2, t, "sliding_window", f"{window} (needs a left context)")
        return cls(vocab_size=vocab, blank_id=blank, hidden_size=hidden,
                   num_layers=enc.get("num_hidden_layers", 24), num_heads=heads,
                   intermediate_size=enc.get("intermediate_size", 4096), ffn_act=ffn,
                   attention_bias=enc.get("attention_bias", True),
                   conv_bias=enc.get("convolution_bias", True), conv_kernel=kernel,
                   subsampling_factor=factor,
                   subsampling_channels=enc.get("subsampling_conv_channels", 256),
                   num_mel_bins=enc.get("num_mel_bins", 80), scale_input=enc.get("scale_input", True),
                   window=window, pred_hidden=cfg.get("decoder_hidden_size", 640),
                   pred_layers=cfg.get("num_decoder_layers", 2), joint_act=joint,
                   max_symbols=cfg.get("max_symbols_per_step", 10))


# ---- layers -------------------------------------------------------------------------------
class Pointwise(Linear):
    """A kernel-1 Conv1d as a projection over (T, C_in): the checkpoint's (out, in, 1) weight."""

    def __init__(self, c_in: int, c_out: int, bias: bool):
        super().__init__(c_in, c_out, bias=bias)
        self.weight = nn.Parameter(torch.empty(c_out, c_in, 1))

    def forward(self, x):
        return linear(x, self.weight.view(self.out_features, self.in_features), self.bias, self.kernel)


class FeedForward(nn.Module):
    def __init__(self, c: NemotronAsrConfig):
        super().__init__()
        self.linear1 = Linear(c.hidden_size, c.intermediate_size, bias=c.attention_bias)
        self.linear2 = Linear(c.intermediate_size, c.hidden_size, bias=c.attention_bias)
        self.act = ACTS[c.ffn_act]

    def forward(self, x):
        return self.linear2(self.act(self.linear1(x)))


class RelAttention(nn.Module):
    """Transformer-XL relative attention over [left-context window ; this step's frames]."""

    def __init__(self, c: NemotronAsrConfig, idx: int):
        super().__init__()
        D, self.h, self.d = c.hidden_size, c.num_heads, c.hidden_size // c.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            Linear(D, D, bias=c.attention_bias) for _ in range(4))
        self.relative_k_proj = Linear(D, D, bias=False)
        self.bias_u = nn.Parameter(torch.empty(self.h, self.d))      # content bias
        self.bias_v = nn.Parameter(torch.empty(self.h, self.d))      # position bias
        self.k_name, self.v_name = f"layers.{idx}.attn.k", f"layers.{idx}.attn.v"
        self._rel_keys: dict = {}     # chunk size -> (weight version, (h, d, Nd)): derived, not state

    def rel_keys(self, C: int, rel: torch.Tensor) -> torch.Tensor:
        """relative_k_proj of the (Nd, D) distance embeddings as (h, d, Nd), kept per chunk size:
        it depends on the weights alone (about a third of a layer's work at T = 7 otherwise)."""
        w = self.relative_k_proj.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device, rel.shape[0])
        hit = self._rel_keys.get(C)
        if hit is None or hit[0] != key:
            rk = self.relative_k_proj(rel).view(-1, self.h, self.d).permute(1, 2, 0).contiguous()
            self._rel_keys[C] = hit = (key, rk)
        return hit[1]

    def forward(self, x, state, rel, idx, visible):
        """x (T, D); rel (h, d, Nd) keys of the distances idx (T, L) points into; visible
        (T, L) over keys [window rows ; T new]. Advances the window in place."""
        T, h, d = x.shape[0], self.h, self.d
        kc, vc = state[self.k_name], state[self.v_name]               # (W - 1, h, d)
        q = self.q_proj(x).view(T, h, d)
        K = torch.cat([kc, self.k_proj(x).view(T, h, d)])              # (L, h, d)
        V = torch.cat([vc, self.v_proj(x).view(T, h, d)])
        kc.copy_(K[K.shape[0] - kc.shape[0]:])
        vc.copy_(V[V.shape[0] - vc.shape[0]:])
        scale = d ** -0.5
        bd = (q + self.bias_v).transpose(0, 1) @ rel                            # (h, T, Nd)
        bd = bd.gather(2, idx.expand(h, -1, -1)) * scale                        # (h, T, L)
        bd = bd.masked_fill(~visible, float("-inf"))
        o = F.scaled_dot_product_attention((q + self.bias_u).transpose(0, 1)[None],
                                           K.transpose(0, 1)[None], V.transpose(0, 1)[None],
                                           attn_mask=bd[None], scale=scale)     # (1, h, T, d)
        return self.o_proj(o[0].transpose(0, 1).reshape(T, h * d))


class ConvModule(nn.Module):
    """Pointwise -> GLU -> causal depthwise (window in the arena) -> LayerNorm -> act -> pointwise."""

    def __init__(self, c: NemotronAsrConfig, idx: int):
        super().__init__()
        D = c.hidden_size
        self.pointwise_conv1 = Pointwise(D, 2 * D, c.conv_bias)
        self.depthwise_conv = nn.Conv1d(D, D, c.conv_kernel, groups=D, bias=c.conv_bias)
        self.norm = nn.LayerNorm(D)
        self.pointwise_conv2 = Pointwise(D, D, c.conv_bias)
        self.act, self.name = ACTS[c.ffn_act], f"layers.{idx}.conv"

    def forward(self, x, state):
        x = F.glu(self.pointwise_conv1(x), dim=-1)                               # (T, D)
        w = self.depthwise_conv
        x = depthwise_causal_conv(x, state[self.name], w.weight[:, 0], w.bias)
        return self.pointwise_conv2(self.act(self.norm(x)))


# ---- block --------------------------------------------------------------------------------
class ConformerBlock(nn.Module):
    """Macaron conformer layer: half FFN, attention, conv, half FFN, final LayerNorm."""

    def __init__(self, c: NemotronAsrConfig, idx: int):
        super().__init__()
        D = c.hidden_size
        self.feed_forward1, self.feed_forward2 = FeedForward(c), FeedForward(c)
        self.self_attn, self.conv = RelAttention(c, idx), ConvModule(c, idx)
        self.norm_feed_forward1, self.norm_self_att, self.norm_conv, self.norm_feed_forward2, \
            self.norm_out = (nn.LayerNorm(D) for _ in range(5))

    def forward(self, x, state, C, rel, idx, visible):
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + self.self_attn(self.norm_self_att(x), state, self.self_attn.rel_keys(C, rel), idx, visible)
        x = x + self.conv(self.norm_conv(x), state)
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)


# ---- encoder ------------------------------------------------------------------------------
class SubsamplingStage(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.depthwise_conv = nn.Conv2d(ch, ch, 3, stride=2, groups=ch)
        self.pointwise_conv = nn.Conv2d(ch, ch, 1)


class Subsampling(nn.Module):
    """Causal strided Conv2d stack over (time, mel), 2x in time per stage, then a projection.
    Each conv's input is its cached last frame(s), one more zero frame on the first chunk."""

    def __init__(self, c: NemotronAsrConfig):
        super().__init__()
        ch, n = c.subsampling_channels, int(math.log2(c.subsampling_factor))
        self.conv_in = nn.Conv2d(1, ch, 3, stride=2)
        self.layers = nn.ModuleList(SubsamplingStage(ch) for _ in range(n - 1))
        freq = [c.num_mel_bins]
        for _ in range(n):
            freq.append((freq[-1] + 3 - 3) // 2 + 1)                  # freq pad (2, 1), kernel 3
        self.shapes = [(1 if i == 0 else ch, 1, f + 3) for i, f in enumerate(freq[:-1])]
        self.linear = Linear(ch * freq[-1], c.hidden_size)

    def forward(self, mel, state, first: bool):
        x = mel[None, None]                                            # (1, 1, M, mel)
        for i, conv in enumerate([self.conv_in] + [s.depthwise_conv for s in self.layers]):
            x = F.pad(x, (2, 1))                                       # freq: (kernel-1, stride-1)
            cache = state[f"sub.{i}.conv"][None]                       # (1, C_in, 1, F + 3)
            pre = [cache.new_zeros(cache.shape), cache] if first else [cache]
            full = torch.cat(pre + [x], dim=2)
            cache.copy_(full[:, :, -1:])
            x = F.conv2d(full, conv.weight, conv.bias, stride=2, groups=conv.groups)
            if i > 0:
                pw = self.layers[i - 1].pointwise_conv
                x = F.conv2d(x, pw.weight, pw.bias)
            x = F.relu(x)
        return self.linear(x[0].transpose(0, 1).reshape(x.shape[2], -1))    # (T, C * F)


class Encoder(nn.Module):
    def __init__(self, c: NemotronAsrConfig):
        super().__init__()
        self.c = c
        self.subsampling = Subsampling(c)
        self.layers = nn.ModuleList(ConformerBlock(c, i) for i in range(c.num_layers))
        self.scale = math.sqrt(c.hidden_size) if c.scale_input else 1.0

    def positions(self, T: int, C: int, seen: int, device):
        """Distances d = query - key over [W - 1 window rows ; T new] with their (Nd, D) sinusoid
        embeddings, the (T, L) index into them and the chunked-limited visibility (T, L)."""
        W1 = self.c.window - 1
        t = torch.arange(T, device=device)[:, None]
        j = torch.arange(W1 + T, device=device)[None, :]
        dist = W1 + t - j
        lo, hi = -(C - 1), W1 + C - 1                                   # visible distances
        diff = t // C - torch.div(j - W1, C, rounding_mode="floor")      # chunks back
        visible = (diff >= 0) & (diff <= W1 // C) & (j >= W1 - min(seen, W1))
        d = torch.arange(hi, lo - 1, -1, device=device, dtype=torch.float32)
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.c.hidden_size, 2, dtype=torch.float32,
                                              device=device) / self.c.hidden_size))
        f = d[:, None] * inv
        rel = torch.stack([f.sin(), f.cos()], dim=-1).reshape(d.shape[0], -1)
        return rel, (hi - dist).clamp(0, hi - lo)[None], visible

    def forward(self, mel, ctx: StepCtx, state, C: int):
        x = self.subsampling(mel, state, ctx.start == 0) * self.scale           # (T, D)
        rel, idx, visible = self.positions(x.shape[0], C, ctx.start, x.device)
        rel = rel.to(x.dtype)
        for layer in self.layers:
            x = layer(x, state, C, rel, idx, visible)
        return x


# ---- RNN-T prediction network and joint -----------------------------------------------------
class Prediction(nn.Module):
    """Embedding -> stacked LSTM -> projection. nn.LSTM holds the weights (checkpoint names);
    the cell is computed here: for one token CPU oneDNN's LSTM took ~4 ms a layer (2 threads,
    the released shape), this well under 1 ms."""

    def __init__(self, c: NemotronAsrConfig):
        super().__init__()
        self.embedding = nn.Embedding(c.vocab_size, c.pred_hidden)
        self.lstm = nn.LSTM(c.pred_hidden, c.pred_hidden, num_layers=c.pred_layers, batch_first=True)
        self.decoder_projector = Linear(c.pred_hidden, c.pred_hidden)

    def step(self, token: int, state) -> None:
        """Feed one token: pred.h/.c advance, pred.out becomes the projected LSTM output."""
        h, c, g = state["pred.h"], state["pred.c"], state["pred.out"]      # (L, H), (L, H), (H,)
        x, m, k = self.embedding.weight[token][None], self.lstm, self.decoder_projector.kernel
        for i in range(m.num_layers):                  # gates (1, 4H): input, forget, cell, output
            gates = linear(x, getattr(m, f"weight_ih_l{i}"), getattr(m, f"bias_ih_l{i}"), k) \
                + linear(h[i: i + 1], getattr(m, f"weight_hh_l{i}"), getattr(m, f"bias_hh_l{i}"), k)
            gi, gf, gc, go = gates.chunk(4, dim=-1)
            ci = torch.sigmoid(gf) * c[i] + torch.sigmoid(gi) * torch.tanh(gc)
            x = torch.sigmoid(go) * torch.tanh(ci)
            c[i].copy_(ci[0])
            h[i].copy_(x[0])
        g.copy_(self.decoder_projector(x)[0])


class Joint(nn.Module):
    def __init__(self, c: NemotronAsrConfig):
        super().__init__()
        self.head = Linear(c.pred_hidden, c.vocab_size)
        self.act = ACTS[c.joint_act]

    def forward(self, f, g):                                                  # (J,), (J,) -> (V,)
        return self.head(self.act(f + g)[None])[0]


# ---- model --------------------------------------------------------------------------------
class Model(TranscriberModel):
    model_type = "nemotron_asr_streaming"

    def __init__(self, c: NemotronAsrConfig):
        super().__init__()
        self.config = c
        self.sample_rate, self.blank_id, self.lookaheads = c.sample_rate, c.blank_id, tuple(c.lookaheads)
        self.factor = c.subsampling_factor
        self.frame_samples = c.hop * c.subsampling_factor
        # pending samples: one chunk at the largest lookahead plus a 400-sample window (>= needed)
        self.features = LogMel(c.num_mel_bins, c.sample_rate, hop=c.hop,
                               max_pending=self.frame_samples * (max(self.lookaheads) + 1) + 400)
        self.encoder = Encoder(c)
        self.encoder_projector = Linear(c.hidden_size, c.pred_hidden)
        self.decoder = Prediction(c)
        self.joint = Joint(c)

    def state_specs(self, capacity, dtype):
        c, i64 = self.config, torch.int64
        specs = [BufferSpec("audio.tail", "conv", (self.features.tail_len,), torch.float32),
                 BufferSpec("audio.pending", "meta", (1,), i64)]
        specs += [BufferSpec(f"sub.{i}.conv", "conv", s, dtype)
                  for i, s in enumerate(self.encoder.subsampling.shapes)]
        win = (c.window - 1, c.num_heads, c.hidden_size // c.num_heads)
        for i in range(c.num_layers):
            specs += [BufferSpec(f"layers.{i}.attn.{n}", "recurrent", win, dtype) for n in "kv"]
            specs.append(BufferSpec(f"layers.{i}.conv", "conv", (c.conv_kernel - 1, c.hidden_size), dtype))
        specs += [BufferSpec("pred.h", "recurrent", (c.pred_layers, c.pred_hidden), dtype),
                  BufferSpec("pred.c", "recurrent", (c.pred_layers, c.pred_hidden), dtype),
                  BufferSpec("pred.out", "recurrent", (c.pred_hidden,), dtype)]
        return specs + [BufferSpec(f"rnnt.{n}", "meta", (1,), i64) for n in ("last", "emitted", "symbols")]

    def input_specs(self, dtype):
        return [InputSpec("mel", (self.config.num_mel_bins,), torch.float32,
                          "log-mel frames (8T, or 8T - 7 on the first chunk); default: from audio.tail"),
                InputSpec("lookahead", (), torch.int64, "right context: attention chunks of lookahead + 1")]

    # ---- audio -------------------------------------------------------------------------------
    def accept_audio(self, pcm: torch.Tensor, state) -> int:
        return self.features.append(pcm, state["audio.tail"], state["audio.pending"])

    def pending_samples(self, state) -> int:
        return int(state["audio.pending"])

    def mel_frames(self, position: int, T: int) -> int:
        return self.factor * T - (self.factor - 1 if position == 0 else 0)

    def chunk_frames(self, position: int, pending: int, lookahead: int, final: bool = False) -> int:
        """Encoder frames the next step runs (0: not enough audio). final: every frame whose mel
        frames are all inside the audio (transformers' offline length), zeros past its end."""
        if final:
            done = 0 if position == 0 else self.mel_frames(0, position)
            total = done + pending // self.config.hop
            return max(0, -(-total // self.factor) - position)
        T = lookahead + 1
        return T if pending >= self.features.needed(self.mel_frames(position, T)) else 0

    # ---- stepping ------------------------------------------------------------------------------
    def forward(self, inputs, ctx: StepCtx, state, all_positions=False):
        """One chunk of ctx.T encoder frames -> {"hidden": (T, D), "encoded": (T, J)}."""
        if ctx.start is None:
            raise ValueError("nemotron_asr_streaming runs eagerly (ctx.start is required)")
        M = self.mel_frames(ctx.start, ctx.T)
        mel = inputs.get("mel")
        if mel is None:
            mel = self.features.take(M, state["audio.tail"], state["audio.pending"])
        if tuple(mel.shape) != (M, self.config.num_mel_bins):
            raise ValueError(f"mel: expected ({M}, {self.config.num_mel_bins}) for {ctx.T} frames "
                             f"at position {ctx.start}, got {tuple(mel.shape)}")
        look = inputs.get("lookahead")
        C = ctx.T if look is None else int(look) + 1
        dtype = self.encoder_projector.weight.dtype
        hidden = self.encoder(mel.to(dtype), ctx, state, C)
        return {"hidden": hidden, "encoded": self.encoder_projector(hidden)}

    def decode(self, encoded: torch.Tensor, ctx: StepCtx, state, keep_logits: bool = False) -> dict:
        """Greedy RNN-T over encoded (T, J), as transformers' generate: blank advances the frame,
        a token feeds the prediction network; max_symbols tokens at one frame force an advance."""
        c, blank = self.config, self.blank_id
        if ctx.start == 0:                       # the prediction network starts from blank
            self.decoder.step(blank, state)
        sym, g = int(state["rnnt.symbols"]), state["pred.out"]
        tokens, frames, logits = [], [], []
        for t in range(encoded.shape[0]):
            while True:
                z = self.joint(encoded[t], g)
                if keep_logits:
                    logits.append(z.float().clone())
                k = int(z.argmax())
                if k == blank:
                    sym = 0
                    break
                tokens.append(k)
                frames.append(ctx.start + t)
                self.decoder.step(k, state)
                sym += 1
                if sym >= c.max_symbols:
                    sym = 0
                    break
        state["rnnt.symbols"].fill_(sym)
        if tokens:
            state["rnnt.last"].fill_(tokens[-1])
            state["rnnt.emitted"].add_(len(tokens))
        return {"tokens": tokens, "frames": frames, "logits": logits}

    # ---- weight names ------------------------------------------------------------------------
    def map_weight_name(self, name: str) -> str | None:
        """transformers' NemotronAsrStreamingForRNNT names are ours; its rope buffer is not saved."""
        return None if name.endswith("encode_positions.inv_freq") else name


CONFIG = NemotronAsrConfig
