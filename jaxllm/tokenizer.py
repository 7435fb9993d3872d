"""Tokenizers: a byte-level one for models trained here, Hugging Face ones from local directories."""
from __future__ import annotations

import os
from typing import Protocol, Sequence


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 = BOS, 257 = EOS, 258 = PAD, 259 = SINK (the learnable
    sink placeholder of sink-token pre-training). Models use a vocab of 264 (padded to 8)."""

    name = "byte"
    vocab_size = 264
    bos_id, eos_id, pad_id, sink_id = 256, 257, 258, 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """``transformers.AutoTokenizer`` from a local directory (never remote code)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                 trust_remote_code=False)
        self.name = os.path.abspath(path)
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` or a local directory holding a Hugging Face tokenizer."""
    if spec == "byte":
        return ByteTokenizer()
    if os.path.isdir(spec):
        return HFTokenizer(spec)
    raise ValueError(f"unknown tokenizer {spec!r}: use 'byte' or a local directory with a "
                     f"Hugging Face tokenizer (tokenizer.json / tokenizer_config.json)")
