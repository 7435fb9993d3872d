"""Tokenizers: a byte-level one for models trained here, Hugging Face ones from local directories."""
from __future__ import annotations

import os
from typing import Protocol, Sequence


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# The files a Hugging Face tokenizer directory may hold (the first four identify one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")


def has_tokenizer(path: str) -> bool:
    """A directory holding a Hugging Face tokenizer's files."""
    return any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES[:4])


def copy_tokenizer(src: str, dst: str) -> None:
    """Copy the tokenizer files of ``src`` into the directory ``dst`` (made if missing)."""
    import shutil
    os.makedirs(dst, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 = BOS, 257 = EOS, 258 = PAD; 259..263 are unused (the
    vocabulary is padded to 264, a multiple of 8). A learnable-sink model's sink token is not
    one of these: it is id ``vocab_size`` (= 264), an extra embedding row (ModelConfig.sink_id).
    """

    name = "byte"
    vocab_size = 264
    bos_id, eos_id, pad_id = 256, 257, 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """``transformers.AutoTokenizer`` from a local directory (never remote code)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer
        self._set(AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                trust_remote_code=False), os.path.abspath(path))

    @classmethod
    def of(cls, tok, name: str) -> "HFTokenizer":
        """A transformers tokenizer built in memory (e.g. from a GGUF file's metadata)."""
        self = cls.__new__(cls)
        self._set(tok, name)
        return self

    def _set(self, tok, name: str) -> None:
        self.tok, self.name = tok, name
        self.vocab_size = len(tok)
        self.eos_id = tok.eos_token_id

    def save(self, directory: str) -> None:
        """Write this tokenizer (and its chat template) as a Hugging Face tokenizer directory."""
        self.tok.save_pretrained(directory)

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the chat template (a tokenizer with several named templates
        gives its "default" one), or None."""
        t = getattr(self.tok, "chat_template", None)
        if isinstance(t, dict):
            t = t.get("default")
        return t or None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def chat(self, messages: list[dict], generation_prompt: bool = True) -> str:
        """``messages`` ([{"role", "content"}]) in the model's chat template, ready for the
        assistant's turn unless ``generation_prompt=False``, rendered as transformers renders it
        but with bounds on time and size (jaxllm.template); ValueError when the tokenizer has no
        template or the template fails."""
        from .template import render
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer of {self.name} has no chat template")
        return render(self.chat_template, messages, generation_prompt,
                      special_tokens=self.tok.special_tokens_map, name=self.name)

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
