"""Silero VAD (v6, 16 kHz): one speech probability per 32 ms chunk, with the real weights of the
installed `silero-vad` package (its TorchScript file; there is no HF directory, so it loads
through load_silero_vad below rather than the registry).

Per chunk, the previous chunk's last 64 samples and 512 new ones (576) are reflect-padded on the
right by 64, an STFT as a strided conv (a fixed 258x1x256 basis, hop 128) gives 4 frames of 129
magnitudes, four conv blocks (strides 1, 2, 2, 1) reduce them to one 128-vector, an
LSTMCell(128, 128) carries it across chunks, and ReLU, a 1x1 conv, a sigmoid and a mean give the
probability. A flashrt.models.protocol.VadModel; its state, by name:
  vad.lstm.h, vad.lstm.c   recurrent (128,) float32: the LSTM cell's state
  vad.context              conv (64,) float32: the last samples of the previous chunk
"""
from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .base import BufferSpec, InputSpec, StepCtx, VadModel, check


# ---- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SileroVADConfig:
    sample_rate: int = 16000
    chunk_samples: int = 512          # new samples per chunk (32 ms)
    context_samples: int = 64         # samples of the previous chunk prepended to each
    filter_length: int = 256          # STFT window: filter_length // 2 + 1 magnitude bins
    hop_length: int = 128
    stft_pad: int = 64                # right reflect-padding before the STFT
    channels: tuple = (129, 128, 64, 64, 128)    # conv blocks: channels[i] -> channels[i + 1]
    strides: tuple = (1, 2, 2, 1)
    hidden_size: int = 128            # LSTMCell width

    @classmethod
    def from_hf(cls, cfg: dict) -> "SileroVADConfig":
        c = cls(**{f.name: tuple(cfg[f.name]) if f.name in ("channels", "strides") else cfg[f.name]
                   for f in fields(cls) if f.name in cfg})
        check(c.channels[0] == c.filter_length // 2 + 1, "silero_vad", "channels",
              f"channels[0]={c.channels[0]} must be filter_length // 2 + 1 = {c.filter_length // 2 + 1}")
        check(len(c.strides) == len(c.channels) - 1, "silero_vad", "strides",
              f"{len(c.strides)} strides for {len(c.channels) - 1} conv blocks")
        check(c.channels[-1] == c.hidden_size, "silero_vad", "hidden_size",
              f"{c.hidden_size} must equal the last conv block's width {c.channels[-1]}")
        return c


# ---- layers -------------------------------------------------------------------------------
class STFT(nn.Module):
    """Magnitude STFT as a conv: basis rows [0, bins) real, [bins, 2 bins) imaginary parts."""

    def __init__(self, c: SileroVADConfig):
        super().__init__()
        self.hop, self.pad, self.bins = c.hop_length, c.stft_pad, c.filter_length // 2 + 1
        self.register_buffer("forward_basis_buffer", torch.zeros(2 * self.bins, 1, c.filter_length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (1, context + chunk) -> (1, bins, frames); the TorchScript model's ops, in its order
        x = F.pad(x, (0, self.pad), mode="reflect")[:, None]
        y = F.conv1d(x, self.forward_basis_buffer, None, self.hop)
        re, im = y[:, : self.bins], y[:, self.bins:]
        return torch.sqrt(re.pow(2) + im.pow(2))


class ConvBlock(nn.Module):
    """Conv1d (kernel 3, padding 1) then ReLU; Silero's reparametrised conv, already folded."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.reparam_conv = nn.Conv1d(cin, cout, 3, stride, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.reparam_conv(x))


class Decoder(nn.Module):
    """LSTMCell over the chunk's 128-vector, then ReLU, a 1x1 conv and a sigmoid."""

    def __init__(self, c: SileroVADConfig):
        super().__init__()
        self.rnn = nn.LSTMCell(c.hidden_size, c.hidden_size)
        self.out = nn.Conv1d(c.hidden_size, 1, 1)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
        # x, h, c (1, hidden) -> prob (1,), new h, c (1, hidden)
        h, c = self.rnn(x, (h, c))
        p = torch.sigmoid(self.out(F.relu(h[..., None])))        # (1, 1, frames=1)
        return p.squeeze(1).mean(1), h, c


# ---- model --------------------------------------------------------------------------------
class Model(VadModel):
    model_type = "silero_vad"

    def __init__(self, c: SileroVADConfig):
        super().__init__()
        self.config = c
        self.sample_rate, self.chunk_samples = c.sample_rate, c.chunk_samples
        self.context_samples = c.context_samples
        self.stft = STFT(c)
        self.encoder = nn.Sequential(*(ConvBlock(a, b, s) for a, b, s in
                                       zip(c.channels[:-1], c.channels[1:], c.strides)))
        self.decoder = Decoder(c)

    def state_specs(self, capacity: int, dtype: torch.dtype) -> list[BufferSpec]:
        # float32 whatever the weights' dtype: the audio context and the LSTM state stay exact
        H, f32 = self.config.hidden_size, torch.float32
        return [BufferSpec("vad.lstm.h", "recurrent", (H,), f32),
                BufferSpec("vad.lstm.c", "recurrent", (H,), f32),
                BufferSpec("vad.context", "conv", (self.context_samples,), f32)]

    def input_specs(self, dtype: torch.dtype) -> list[InputSpec]:
        return [InputSpec("pcm", (self.chunk_samples,), torch.float32,
                          "consecutive chunks of samples in [-1, 1] at sample_rate")]

    def map_weight_name(self, name: str) -> str | None:
        # the TorchScript decoder is Sequential(Dropout, ReLU, Conv1d, Sigmoid): index 2 is the conv
        return name.replace("decoder.decoder.2.", "decoder.out.")

    def forward(self, inputs: dict, ctx: StepCtx, state, all_positions: bool = False) -> dict:
        """ctx.T chunks, one after another (each needs the LSTM state the last one left):
        inputs["pcm"] (T, chunk_samples) -> {"prob": (T,)} float32 ((1,): the last, by default)."""
        pcm, w = inputs["pcm"], self.stft.forward_basis_buffer.dtype
        h, c, prev = state["vad.lstm.h"], state["vad.lstm.c"], state["vad.context"]
        probs = []
        for t in range(ctx.T):
            x = torch.cat([prev, pcm[t]]).to(w)[None]                  # (1, context + chunk)
            z = self.encoder(self.stft(x))                              # (1, hidden, 1)
            p, h1, c1 = self.decoder(z[..., 0], h[None].to(w), c[None].to(w))
            probs.append(p)
            h.copy_(h1[0])
            c.copy_(c1[0])
            prev.copy_(pcm[t, -self.context_samples:])
        p = torch.cat(probs).float()
        return {"prob": p if all_positions else p[-1:]}


# ---- weights from the installed package -----------------------------------------------------
def package_jit_path() -> Path:
    """The TorchScript file inside the installed `silero-vad` wheel. Found without importing the
    package (its import sets torch's thread count to 1 for the whole process)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("Silero VAD needs the `silero-vad` package (its wheel ships the weights): "
                          "pip install 'flashrt[speech]' or pip install 'silero-vad>=6'")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "silero_vad.jit"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (silero-vad >= 6 ships data/silero_vad.jit)")
    return path


def load_silero_vad(device="cpu", dtype: torch.dtype = torch.float32) -> Model:
    """The installed package's Silero VAD (16 kHz model of silero_vad.jit; not the wheel's
    silero_vad_16k.safetensors, a different checkpoint), on `device` in `dtype`, eval mode."""
    with warnings.catch_warnings():      # torch.jit.load is deprecated; the wheel ships TorchScript
        warnings.simplefilter("ignore", DeprecationWarning)
        src = torch.jit.load(str(package_jit_path()), map_location="cpu")._model
    stft = src.stft
    cfg = {"filter_length": int(stft.filter_length), "hop_length": int(stft.hop_length),
           "stft_pad": int(stft.padding.padding[1]), "context_samples": int(src.context_size_samples)}
    net = Model(SileroVADConfig.from_hf(cfg))
    tensors = {net.map_weight_name(n): t for n, t in [*src.named_parameters(), *src.named_buffers()]}
    own = net.state_dict()
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    bad = [n for n in own if n in tensors and tuple(tensors[n].shape) != tuple(own[n].shape)]
    if missing or extra or bad:
        raise ValueError(f"silero_vad.jit does not match this model: missing {missing}, "
                         f"unexpected {extra}, shape mismatch {bad}")
    with torch.no_grad():
        for n, t in own.items():
            t.copy_(tensors[n])
    return net.to(device=device, dtype=dtype).eval()


CONFIG = SileroVADConfig      # the config class (from_hf), as every model file has
