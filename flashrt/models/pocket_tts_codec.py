"""Pocket TTS's audio codec (transformers' pocket_tts_audio_tokenizer: Mimi's architecture with a
continuous latent): latents -> 24 kHz PCM, streamed one 80 ms frame at a time, and the encoder
path one shot for voice prompts. Lives in the checkpoint's `audio_tokenizer/` folder.

Order: config -> layers -> block -> model -> weight-name mapping (same in every model file).
A CodecModel (models/protocol.py). The decoder is causal, so its whole state is fixed-size:
  codec.position           meta (1,) int64: transformer steps decoded (its rotary positions)
  codec.<conv>.ctx         conv (C_in, (k - 1) * dilation): each causal conv's left context
  codec.<conv_tr>.tail     conv (C_out, k - stride): each transposed conv's pending overlap
  codec.tf.{i}.k / .v      recurrent (window - 1, heads, head_dim): the sliding attention window
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import (BufferSpec, CodecModel, InputSpec, Linear, Rotary, check, check_rope, require,
                   rotary_tables, rotate)

ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}
# torch's CPU transposed convolution runs grouped ones, and inputs of fewer elements than this,
# on its native col2im path (ConvParams::use_mkldnn): 1.5-3x slower than one GEMM or product
SMALL_CONV = 20480


# ---- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CodecConfig:
    sample_rate: int
    hidden_size: int
    num_filters: int
    ratios: tuple                 # upsampling ratios of the decoder (the encoder's, reversed)
    num_residual_layers: int
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    compress: int
    upsample_groups: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    head_dim: int
    hidden_act: str
    norm_eps: float
    rope_theta: float
    sliding_window: int
    latent_stride: int
    latent_dim: int

    @property
    def frame_size(self) -> int:
        return math.prod(self.ratios) * self.latent_stride

    @classmethod
    def from_hf(cls, cfg: dict) -> "CodecConfig":
        t = "pocket_tts_audio_tokenizer"
        rope = check_rope(cfg, t)
        check(cfg.get("use_causal_conv", True), t, "use_causal_conv", "False (streaming needs causal)")
        check(cfg.get("pad_mode", "constant") == "constant", t, "pad_mode", cfg.get("pad_mode"))
        check(cfg.get("trim_right_ratio", 1.0) == 1.0, t, "trim_right_ratio", "only 1.0 is causal")
        check(not cfg.get("use_conv_shortcut", False), t, "use_conv_shortcut", "True")
        check(cfg.get("audio_channels", 1) == 1, t, "audio_channels", "only mono")
        check(cfg.get("encoder_config", {}) is not None and cfg.get("decoder_config", {}) is not None,
              t, "encoder_config/decoder_config", "a codec without one of its halves")
        check(not cfg.get("attention_bias", False), t, "attention_bias", "bias is not implemented")
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        check(act in ACTS, t, "hidden_act", act)
        hidden, heads = require(cfg, "hidden_size", t), cfg.get("num_attention_heads", 8)
        check(cfg.get("num_key_value_heads", heads) == heads, t, "num_key_value_heads", "GQA")
        ratios = tuple(cfg.get("upsampling_ratios") or (6, 5, 4))
        c = cls(sample_rate=cfg.get("sampling_rate", 24000), hidden_size=hidden,
                num_filters=cfg.get("num_filters", 64), ratios=ratios,
                num_residual_layers=cfg.get("num_residual_layers", 1),
                kernel_size=cfg.get("kernel_size", 7), last_kernel_size=cfg.get("last_kernel_size", 3),
                residual_kernel_size=cfg.get("residual_kernel_size", 3),
                dilation_growth_rate=cfg.get("dilation_growth_rate", 2), compress=cfg.get("compress", 2),
                upsample_groups=cfg.get("upsample_groups", 512),
                num_hidden_layers=cfg.get("num_hidden_layers", 2),
                intermediate_size=cfg.get("intermediate_size", 2048), num_attention_heads=heads,
                head_dim=cfg.get("head_dim") or hidden // heads, hidden_act=act,
                norm_eps=cfg.get("norm_eps", 1e-5), rope_theta=rope.get("rope_theta", 10000.0),
                sliding_window=cfg.get("sliding_window", 250),
                latent_stride=cfg.get("latent_stride", 16), latent_dim=cfg.get("latent_dim", 32))
        # transformers drops the latent-rate resampling when the two rates coincide
        check(c.sample_rate / math.prod(ratios) != c.sample_rate / c.frame_size, t, "latent_stride",
              "equal SEANet and latent frame rates (no resampling) is not implemented")
        return c


@dataclass(frozen=True)
class VoiceRules:
    """How a voice prompt is cut before encoding: transformers' PocketTTSFeatureExtractor (same
    knobs and defaults). end_on_pause: cut the trailing silence (analysis frames more than
    silence_floor_db under the loudest), fade the last fade_out_duration s out, append
    pause_duration s of zeros; prompts that stop on speech make the model continue them."""
    end_on_pause: bool = True
    pause_duration: float = 0.08
    fade_out_duration: float = 0.02
    silence_floor_db: float = 35.0
    analysis_frame_duration: float = 0.02

    def prepare(self, pcm: torch.Tensor, sample_rate: int) -> torch.Tensor:
        """(N,) float32 -> (M,) float32, op for op the feature extractor's _end_on_pause."""
        if not self.end_on_pause:
            return pcm
        n = max(1, int(self.analysis_frame_duration * sample_rate))
        frames = pcm.shape[-1] // n
        if frames == 0:
            return pcm
        rms = pcm[: frames * n].reshape(frames, n).square().mean(-1).sqrt()       # (frames,)
        db = 20 * torch.log10(rms + 1e-12)
        end = (int(torch.nonzero(db > db.max() - self.silence_floor_db).flatten()[-1]) + 1) * n
        out = pcm[:end].clone()
        fade = min(int(self.fade_out_duration * sample_rate), end)
        out[end - fade:] *= torch.linspace(1, 0, fade, dtype=out.dtype, device=out.device)
        return torch.cat([out, out.new_zeros(int(self.pause_duration * sample_rate))])


# ---- layers -------------------------------------------------------------------------------
class Conv(nn.Module):
    """A causal Conv1d. stream(): the left context is a state buffer; once(): transformers'
    unstreamed padding (context of zeros, or the first sample repeated, plus the right padding
    that makes a strided conv cover every input)."""

    def __init__(self, cin, cout, k, stride=1, dilation=1, bias=True, pad_mode="constant"):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, stride, dilation=dilation, bias=bias)
        self.k_eff, self.stride, self.pad_mode = (k - 1) * dilation + 1, stride, pad_mode
        self.context = self.k_eff - stride
        self.buf = ""                                      # state name, set by the model

    def stream(self, x, state):                            # x (C_in, T), stride 1
        if self.context == 0:
            return self.conv(x)
        ctx = state[self.buf]
        xx = torch.cat([ctx, x], dim=1)
        ctx.copy_(xx[:, xx.shape[1] - self.context:])
        return self.conv(xx)

    def once(self, x):                                     # x (C_in, L)
        n = math.ceil((x.shape[-1] - self.k_eff + self.context) / self.stride + 1) - 1
        extra = n * self.stride + self.k_eff - self.context - x.shape[-1]
        if self.pad_mode == "replicate":
            return self.conv(F.pad(x[None], (self.context, extra), mode="replicate")[0])
        return self.conv(F.pad(x, (self.context, extra)))


class ConvTr(nn.Module):
    """A causal ConvTranspose1d: each input step emits `stride` outputs; the last k - stride of
    its contribution wait in `tail` (no bias yet) for the next step's."""

    def __init__(self, cin, cout, k, stride, groups=1, bias=True):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, k, stride, groups=groups, bias=bias)
        self.stride, self.overlap, self.buf = stride, k - stride, ""

    def stream(self, x, state):                            # x (C_in, T) -> (C_out, T * stride)
        c, s, T = self.conv, self.stride, x.shape[1]
        depthwise = c.groups == x.shape[0] == c.out_channels
        if self.overlap == s and (depthwise or (c.groups == 1 and x.numel() < SMALL_CONV)):
            # k = 2s: input step t writes outputs [ts, ts + 2s), two blocks of s: products
            # z (C_out, T, 2, s), then one shifted add
            if depthwise:                  # the latent upsampler: an outer product
                z = (x[:, :, None] * c.weight[:, 0, None, :]).view(x.shape[0], T, 2, s)
            else:                          # one GEMM on the weight as stored: x^T (C_in, C_out k)
                z = (x.t() @ c.weight.view(x.shape[0], -1)).view(T, -1, 2, s).transpose(0, 1)
            y = F.pad(z[:, :, 0].flatten(1), (0, s)) + F.pad(z[:, :, 1].flatten(1), (s, 0))
        else:
            y = F.conv_transpose1d(x, c.weight, None, s, groups=c.groups)
        tail, n = state[self.buf], T * s
        y[:, : self.overlap] += tail
        tail.copy_(y[:, n:])
        y = y[:, :n]
        return y if c.bias is None else y + c.bias[:, None]


class ResBlock(nn.Module):
    def __init__(self, c: CodecConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // c.compress
        self.block = nn.ModuleList([nn.ELU(), Conv(dim, hidden, c.residual_kernel_size, dilation=dilation),
                                    nn.ELU(), Conv(hidden, dim, 1)])

    def forward(self, x, state=None):
        h = x
        for i in (1, 3):
            h = F.elu(h)
            h = self.block[i].once(h) if state is None else self.block[i].stream(h, state)
        return x + h


class LayerScale(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        return self.scale * x


# ---- block --------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, c: CodecConfig):
        super().__init__()
        self.h, self.d, w = c.num_attention_heads, c.head_dim, c.hidden_size
        self.q_proj, self.k_proj = Linear(w, self.h * self.d, bias=False), Linear(w, self.h * self.d, bias=False)
        self.v_proj, self.o_proj = Linear(w, self.h * self.d, bias=False), Linear(self.h * self.d, w, bias=False)

    def forward(self, x, rope, kw, vw, visible):
        """x (T, hidden); kw, vw (W - 1, H, D): the window before x, advanced in place;
        visible (T, W - 1 + T) bool: key j is in query t's window."""
        T = x.shape[0]
        q = rotate(self.q_proj(x).view(T, self.h, self.d), rope)
        k = rotate(self.k_proj(x).view(T, self.h, self.d), rope)
        K, V = torch.cat([kw, k]), torch.cat([vw, self.v_proj(x).view(T, self.h, self.d)])
        kw.copy_(K[K.shape[0] - kw.shape[0]:])
        vw.copy_(V[V.shape[0] - vw.shape[0]:])
        # batched (1, H, T, D): CPU SDPA runs unbatched masked inputs 1.5x slower
        q, K, V = q.transpose(0, 1)[None], K.transpose(0, 1)[None], V.transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, K, V, attn_mask=visible, scale=self.d ** -0.5)[0]
        return self.o_proj(o.transpose(0, 1).reshape(T, self.h * self.d))


class TransformerLayer(nn.Module):
    def __init__(self, c: CodecConfig):
        super().__init__()
        w = c.hidden_size
        self.input_layernorm = nn.LayerNorm(w, eps=c.norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = nn.LayerNorm(w, eps=c.norm_eps)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = Linear(w, c.intermediate_size, bias=False), Linear(c.intermediate_size, w, bias=False)
        self.self_attn_layer_scale, self.mlp_layer_scale = LayerScale(w), LayerScale(w)
        self.act = ACTS[c.hidden_act]

    def forward(self, x, rope, kw, vw, visible):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope, kw, vw, visible))
        h = self.mlp.fc2(self.act(self.mlp.fc1(self.post_attention_layernorm(x))))
        return x + self.mlp_layer_scale(h)


class Transformer(nn.Module):
    def __init__(self, c: CodecConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(c) for _ in range(c.num_hidden_layers))
        self.window = c.sliding_window

    def forward(self, x, pos0, rotary, windows):
        """x (T, hidden) at positions pos0 + [0, T) (pos0 a (1,) tensor); windows: per layer (K, V)."""
        T, W = x.shape[0], self.window
        qpos = pos0 + torch.arange(T, device=x.device)
        kpos = pos0 - (W - 1) + torch.arange(W - 1 + T, device=x.device)
        visible = (kpos[None] >= 0) & (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - W)
        rope = rotary_tables(*rotary(qpos, x.dtype))
        for layer, (kw, vw) in zip(self.layers, windows):
            x = layer(x, rope, kw, vw, visible)
        return x


def seanet(c: CodecConfig, decoder: bool) -> nn.ModuleList:
    """transformers' SEANet layer lists, index for index (ELUs included: they name the weights)."""
    res = [c.dilation_growth_rate ** j for j in range(c.num_residual_layers)]
    scale = 2 ** len(c.ratios)
    if decoder:
        mods = [Conv(c.hidden_size, scale * c.num_filters, c.kernel_size)]
        for r in c.ratios:
            ch = scale * c.num_filters
            mods += [nn.ELU(), ConvTr(ch, ch // 2, 2 * r, r)] + [ResBlock(c, ch // 2, d) for d in res]
            scale //= 2
        return nn.ModuleList(mods + [nn.ELU(), Conv(c.num_filters, 1, c.last_kernel_size)])
    mods, scale = [Conv(1, c.num_filters, c.kernel_size)], 1
    for r in reversed(c.ratios):
        ch = scale * c.num_filters
        mods += [ResBlock(c, ch, d) for d in res] + [nn.ELU(), Conv(ch, 2 * ch, 2 * r, stride=r)]
        scale *= 2
    return nn.ModuleList(mods + [nn.ELU(), Conv(scale * c.num_filters, c.hidden_size, c.last_kernel_size)])


# ---- model --------------------------------------------------------------------------------
class Model(CodecModel):
    model_type = "pocket_tts_audio_tokenizer"
    voice_rules = VoiceRules()      # the feature extractor's defaults (frozen: shared, read-only)

    def __init__(self, c: CodecConfig):
        super().__init__()
        self.config = c
        self.sample_rate, self.frame_size, self.latent_dim = c.sample_rate, c.frame_size, c.latent_dim
        s = c.latent_stride
        self.encoder = nn.Module()
        self.encoder.encoder_seanet = nn.Module()
        self.encoder.encoder_seanet.layers = seanet(c, decoder=False)
        self.encoder.encoder_transformer = Transformer(c)
        self.encoder.downsample = Conv(c.hidden_size, c.latent_dim, 2 * s, stride=s, bias=False,
                                       pad_mode="replicate")
        self.decoder = nn.Module()
        self.decoder.upsample = ConvTr(c.hidden_size, c.hidden_size, 2 * s, s, groups=c.upsample_groups,
                                       bias=False)
        self.decoder.decoder_transformer = Transformer(c)
        self.decoder.decoder_seanet = nn.Module()
        self.decoder.decoder_seanet.layers = seanet(c, decoder=True)
        self.latent_proj = nn.Conv1d(c.latent_dim, c.hidden_size, 1, bias=False)
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        self._streamed = []                  # (module, state name, shape): decoder convs with state
        for name, m in self.decoder.named_modules():
            if isinstance(m, Conv) and m.context:
                m.buf = f"codec.{name}.ctx"
                self._streamed.append((m.buf, (m.conv.in_channels, m.context)))
            elif isinstance(m, ConvTr):
                m.buf = f"codec.{name}.tail"
                self._streamed.append((m.buf, (m.conv.out_channels, m.overlap)))

    def state_specs(self, capacity, dtype):
        c = self.config
        win = (c.sliding_window - 1, c.num_attention_heads, c.head_dim)
        return ([BufferSpec("codec.position", "meta", (1,), torch.int64)]
                + [BufferSpec(n, "conv", shape, dtype) for n, shape in self._streamed]
                + [BufferSpec(f"codec.tf.{i}.{kv}", "recurrent", win, dtype)
                   for i in range(c.num_hidden_layers) for kv in ("k", "v")])

    def input_specs(self, dtype):
        return [InputSpec("latent", (self.latent_dim,), torch.float32, "latents to decode")]

    def forward(self, inputs, ctx, state, all_positions=True):
        c, d = self.config, self.decoder
        lat = inputs["latent"].to(self.latent_proj.weight.dtype)                    # (T, latent)
        x = d.upsample.stream(F.conv1d(lat.t()[None], self.latent_proj.weight)[0], state)
        pos = state["codec.position"]
        windows = [(state[f"codec.tf.{i}.k"], state[f"codec.tf.{i}.v"]) for i in range(c.num_hidden_layers)]
        x = d.decoder_transformer(x.t(), pos, self.rotary, windows).t()            # (hidden, T * s)
        pos.add_(x.shape[1])
        for m in d.decoder_seanet.layers:
            x = F.elu(x) if isinstance(m, nn.ELU) else m.stream(x, state) if not isinstance(m, ResBlock) else m(x, state)
        return {"pcm": x.float().reshape(lat.shape[0], self.frame_size)}

    @torch.no_grad()
    def encode(self, pcm):
        """(N,) PCM -> (ceil(N / frame_size), latent_dim): zero-padded to whole frames, as
        transformers' feature extractor pads (the pause is voice_rules.prepare's, before)."""
        c, e = self.config, self.encoder
        x = F.pad(pcm.to(self.latent_proj.weight.dtype), (0, -pcm.shape[0] % self.frame_size))[None]
        for m in e.encoder_seanet.layers:
            x = F.elu(x) if isinstance(m, nn.ELU) else m.once(x) if isinstance(m, Conv) else m(x)
        W = c.sliding_window
        windows = [(x.new_zeros(W - 1, c.num_attention_heads, c.head_dim),) * 2
                   for _ in range(c.num_hidden_layers)]        # empty window: positions < 0 unseen
        h = e.encoder_transformer(x.t(), torch.zeros(1, dtype=torch.int64, device=x.device),
                                  self.rotary, [(k.clone(), v.clone()) for k, v in windows])
        return e.downsample.once(h.t()).t().float()

    # ---- weight-name mapping: transformers' names, one to one (CodecModel default) --------


CONFIG = CodecConfig
