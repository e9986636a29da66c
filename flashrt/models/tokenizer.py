"""Tokenizers: the checkpoint's own (through transformers) or a byte-level fallback.

Random-weight checkpoints written by make_checkpoint ship no tokenizer files; the byte-level
tokenizer still lets text go in and out (ids 0..255 are bytes, other ids print as <id>).
"""
from __future__ import annotations

from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ByteTokenizer:
    kind = "bytes"

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"byte tokenizer needs vocab_size >= 256, checkpoint has {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append(f"<{i}>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    kind = "hf"

    def __init__(self, path: Path):
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(path: Path, vocab_size: int):
    if any((path / f).exists() for f in _TOKENIZER_FILES):
        return HFTokenizer(path)
    return ByteTokenizer(vocab_size)
