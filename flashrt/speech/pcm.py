"""Checked PCM input shared by the speech streams: every refusal happens before any write."""
from __future__ import annotations

import numpy as np
import torch


def mono_samples(pcm, sample_rate, expected_rate: int, device) -> torch.Tensor:
    """pcm (1-D float32 in [-1, 1] or int16, torch or numpy) as float32 on device, or a
    ValueError naming what is wrong and what was expected."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) \
            or sample_rate != expected_rate:
        raise ValueError(f"sample_rate {sample_rate!r}: this model takes {expected_rate} Hz "
                         "PCM (resample first)")
    if isinstance(pcm, np.ndarray):         # np.frombuffer(frame, np.int16) is read-only
        pcm = torch.from_numpy(pcm if pcm.flags.writeable else pcm.copy())
    if not isinstance(pcm, torch.Tensor):
        raise ValueError(f"pcm: expected a 1-D torch.Tensor or numpy array of float32 or int16 "
                         f"samples, got {type(pcm).__name__}")
    if pcm.dim() != 1:
        raise ValueError(f"pcm: expected 1-D mono samples (n,), got shape {tuple(pcm.shape)} "
                         "(pass one channel)")
    if pcm.dtype == torch.int16:
        return pcm.to(device).float() / 32768.0
    if pcm.dtype != torch.float32:
        raise ValueError(f"pcm: expected float32 samples in [-1, 1] or int16 samples, got {pcm.dtype}")
    x = pcm.to(device)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("pcm: has non-finite samples (NaN or inf)")
    return x
