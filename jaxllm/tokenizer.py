"""Tokenizers: a byte-level one for models trained here, Hugging Face ones from local directories."""
from __future__ import annotations

import os
from typing import Optional, Protocol, Sequence

from .confine import confined


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# The files a Hugging Face tokenizer directory may hold (the first four identify one;
# transformers 5 saves the chat template apart, as chat_template.jinja).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")


def has_tokenizer(path: str) -> bool:
    """A directory holding a Hugging Face tokenizer's files."""
    return any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES[:4])


def _confined_files(src: str) -> dict[str, str]:
    """name -> real path of the tokenizer files in ``src``, each refused if it leads outside
    ``src`` (a symlink to a file elsewhere would be read, or copied into a directory a user
    publishes)."""
    return {n: confined(src, os.path.join(src, n), src, f"tokenizer file {n}")
            for n in TOKENIZER_FILES if os.path.exists(os.path.join(src, n))}


def copy_tokenizer(src: str, dst: str) -> None:
    """Copy the tokenizer files of ``src`` into the directory ``dst`` (made if missing); the
    files themselves, never links."""
    import shutil
    os.makedirs(dst, exist_ok=True)
    for name, real in _confined_files(src).items():
        shutil.copyfile(real, os.path.join(dst, name))


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


class HFTokenizer:
    """``transformers.AutoTokenizer`` from a local directory (never remote code); or, built in
    memory (a GGUF file's), a ``tokenizers.Tokenizer`` used directly, with transformers' object
    made only when it is asked for (:meth:`save`, :attr:`tok`): importing transformers is most
    of such a load's time."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer
        _confined_files(path)
        try:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                trust_remote_code=False)
        except ValueError as e:
            if "trust_remote_code" in str(e):  # transformers' advice; jaxllm runs no remote code
                raise ValueError(f"{path}: the tokenizer needs code from the model's repository "
                                 f"(trust_remote_code), which jaxllm never runs: use a tokenizer "
                                 f"with a tokenizer.json") from None
            raise ValueError(f"{path}: the tokenizer cannot be read: {_first_line(e)}") from None
        except Exception as e:
            # tokenizers' own errors (a malformed tokenizer.json, merges naming unknown tokens)
            # are plain Exceptions: one line that names the directory.
            raise ValueError(f"{path}: the tokenizer files cannot be read "
                             f"({type(e).__name__}: {_first_line(e)})") from None
        self._set(tok, os.path.abspath(path))

    @classmethod
    def of(cls, tok, name: str) -> "HFTokenizer":
        """A transformers tokenizer built in memory."""
        self = cls.__new__(cls)
        self._set(tok, name)
        return self

    @classmethod
    def of_backend(cls, backend, name: str, special_tokens: dict, chat_template: str | None,
                   build) -> "HFTokenizer":
        """A ``tokenizers.Tokenizer`` whose special tokens are added already: encoded and
        decoded as transformers' fast tokenizer does (``add_special_tokens=False``, no clean-up
        of spaces); ``special_tokens`` is transformers' ``special_tokens_map``; ``build()`` makes
        the equivalent ``PreTrainedTokenizerFast`` when one is needed."""
        self = cls.__new__(cls)
        self._tok, self._build, self.name = None, build, name
        self._backend, self._special, self._template = backend, special_tokens, chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        eos = special_tokens.get("eos_token")
        self.eos_id = None if eos is None else backend.token_to_id(eos)
        return self

    def _set(self, tok, name: str) -> None:
        self._tok, self.name, self._backend = tok, name, None
        self.vocab_size = len(tok)
        self.eos_id = tok.eos_token_id

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` that encodes (transformers' own, for a directory's)."""
        return self._backend if self._backend is not None else self.tok.backend_tokenizer

    @property
    def tok(self):
        """The transformers tokenizer."""
        if self._tok is None:
            self._tok = self._build()
        return self._tok

    @property
    def special_tokens(self) -> dict:
        """transformers' ``special_tokens_map`` (bos_token, eos_token, ...)."""
        return self._special if self._backend is not None else self.tok.special_tokens_map

    def save(self, directory: str) -> None:
        """Write this tokenizer (and its chat template) as a Hugging Face tokenizer directory."""
        self.tok.save_pretrained(directory)

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the chat template (a tokenizer with several named templates
        gives its "default" one), or None."""
        t = self._template if self._backend is not None else \
            getattr(self.tok, "chat_template", None)
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
                      special_tokens=self.special_tokens, name=self.name)

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tok.decode(ids)


def encode_head(tok: Tokenizer, text: str, n: Optional[int]) -> tuple[list[int], bool]:
    """The first ``n`` tokens of ``text`` (all of them when ``n`` is None) and whether the text
    holds more, encoding only as much of the text as they need (``ppl``'s default 4,096 tokens
    of a long text: docs/CPU.md, "One block traced for every layer").

    A prefix is cut after a line break and kept only when it yields ``n`` tokens and a margin
    more: tokenizers split text into pieces (words, runs of spaces or punctuation) before they
    merge, and no piece reaches back over a line, so the tokens before the cut's last line are
    the whole text's (checked against whole-text encoding in tests/test_gguf.py)."""
    if n is None:
        return list(tok.encode(text)), False
    chars = max(1 << 14, 8 * n)
    while chars < len(text):
        cut = text.rfind("\n", 0, chars) + 1
        if cut > 0:
            ids = tok.encode(text[:cut])
            if len(ids) >= n + _MARGIN:
                return list(ids[:n]), True
        chars *= 2
    ids = tok.encode(text)
    return list(ids[:n]), len(ids) > n


_MARGIN = 64  # tokens past the n kept: more than the last line's pieces can change


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` or a local directory holding a Hugging Face tokenizer."""
    if spec == "byte":
        return ByteTokenizer()
    if os.path.isdir(spec):
        return HFTokenizer(spec)
    raise ValueError(f"unknown tokenizer {spec!r}: use 'byte' or a local directory with a "
                     f"Hugging Face tokenizer (tokenizer.json / tokenizer_config.json)")
