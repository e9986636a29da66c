"""The capsule file's native loader: a whole load in one call when the entry table is known."""
from __future__ import annotations

import numpy as np
import torch

from . import _ext as ext
from .hashes import _spans

def zero_spans(buf: torch.Tensor, offsets, nbytes) -> None:
    """Zero the spans (offsets[i], nbytes[i]) of the uint8 CPU tensor `buf`."""
    offsets, nbytes = _spans(buf, offsets, nbytes, 1, "zero_spans")
    if ext.HAVE_EXT:
        ext.C.zero_spans(buf.data_ptr(), buf.numel(), offsets, nbytes)
        return
    for o, n in zip(offsets.tolist(), nbytes.tolist()):
        buf[o:o + n].zero_()



def load_known_table(fd: int, keys, fixed, base: int, size: int, offsets, nbytes, gap_offsets,
                     gap_nbytes, block: int):
    """A capsule file read into the host buffer [base, base + size) in one native call (header,
    metadata, payload with its block checksums, file checksum) when its metadata has exactly
    `keys` and the (key, value) pairs `fixed`, among them the "entries" table the payload spans
    (int64 arrays offsets, nbytes: buffer offsets in file order) and the gap spans were derived
    from. Returns (status, metadata):

    * ("loaded", md): payload in the buffer, gaps zeroed, checksum verified;
    * ("short", md) / ("mismatch", md): the payload ended early / failed the checksum; the
      buffer was written;
    * ("not_fast", None): the header is not in the form save writes, or differs from what is
      expected; nothing was written, and the caller reads the file the general way.

    None without the extension (the general reader does it all). The extension bounds every
    span by the buffer and takes int64 arrays only, so the tables go as they are: this is
    called once per load."""
    if not ext.HAVE_EXT:
        return None
    return ext.C.load_known_table(fd, keys, fixed, base, size, offsets, nbytes, gap_offsets,
                               gap_nbytes, block)
