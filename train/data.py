"""Training data: text sources -> one token array on disk -> fixed-length samples in a
deterministic, resumable order.

Sources (``TrainConfig.data``):
* ``builtin``: the embedded corpus (Python's documentation, ~750 KB; jaxllm.corpus).
* ``stdlib``: every ``.py`` file of the running Python's standard library (~30 MB), sorted by
  path, then the embedded corpus: a corpus large enough not to be memorised by a small model,
  present on every machine.
* ``site``: the source and documentation text of everything installed for the running Python
  (the standard library and every site-packages directory: ``.py``/``.pyi``/``.rst``/``.md``/
  ``.txt`` files and the packages' ``METADATA`` READMEs, each under 1 MB and valid UTF-8) plus the
  embedded corpus, deduplicated by content and ordered by content hash, so packages are mixed and
  the held-out tail is a random sample of whole documents. Hundreds of MB where a machine has a
  scientific stack installed; its size and fingerprint are recorded with the run
  (``site_manifest``), since they depend on what the machine has installed.
* a ``.txt`` / ``.jsonl`` (``"text"`` field) / ``.parquet`` (``text`` column) file, or a
  directory of them (sorted, recursive).
* ``hf:NAME[:CONFIG]:SPLIT``: a Hugging Face ``datasets`` dataset's ``text`` column (streamed;
  needs ``pip install datasets`` and network access).

Documents are joined with the tokenizer's EOS. Samples are consecutive ``seq_len + 1``-token
windows of that stream (targets overlap inputs by one); the last ``holdout`` share is held out.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import sysconfig
from typing import Iterator, Optional

import numpy as np

from jaxllm.tokenizer import ByteTokenizer, Tokenizer

SOURCES = "builtin | stdlib | site | FILE.txt|.jsonl|.parquet | DIRECTORY | hf:NAME[:CONFIG]:SPLIT"


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__"))
        out.extend(os.path.join(d, f) for f in sorted(files) if f.endswith(".py"))
    return out


SITE_SUFFIXES = (".py", ".pyi", ".rst", ".md", ".txt")
SITE_MAX_BYTES = 1 << 20  # larger files are generated tables and vendored blobs, not prose/code


def _site_roots() -> list[str]:
    """The standard library and every site-packages directory of the running Python."""
    import site
    roots = [sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")]
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # some virtualenv shims lack getsitepackages
        pass
    roots = sorted({os.path.realpath(r) for r in roots if os.path.isdir(r)})
    # A root inside another (a venv's site-packages under its stdlib) is walked with it.
    return [r for r in roots if not any(r.startswith(o + os.sep) for o in roots)]


def _site_documents() -> list[tuple[str, bytes]]:
    """(sha1, utf-8 bytes) of every distinct site document, sorted by hash."""
    from jaxllm.corpus import builtin_corpus
    docs = {}
    for root in _site_roots():
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", "node_modules"))
            meta = d.endswith(".dist-info")
            for f in sorted(files):
                if not (f.endswith(SITE_SUFFIXES) or (meta and f == "METADATA")):
                    continue
                path = os.path.join(d, f)
                try:
                    if os.path.getsize(path) > SITE_MAX_BYTES:
                        continue
                    with open(path, "rb") as fh:
                        raw = fh.read()
                    raw.decode("utf-8")  # binary or legacy-encoded files are skipped
                except (OSError, UnicodeDecodeError):
                    continue
                if raw.strip():
                    docs[hashlib.sha1(raw).hexdigest()] = raw
    raw = builtin_corpus().encode("utf-8")
    docs[hashlib.sha1(raw).hexdigest()] = raw
    return sorted(docs.items())


def _manifest(docs: list[tuple[str, bytes]]) -> dict:
    """What ``site`` held: documents, bytes and a fingerprint of their hashes (two machines with
    the same fingerprint train on the same text)."""
    h = hashlib.sha1("".join(k for k, _ in docs).encode()).hexdigest()
    return {"source": "site", "documents": len(docs), "bytes": sum(len(v) for _, v in docs),
            "fingerprint": h, "roots": _site_roots()}


def manifest_path(tokens_path: str) -> str:
    return tokens_path[:-len(".npy")] + ".json"


def _read_file(path: str) -> Iterator[str]:
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)["text"]
                    except (ValueError, KeyError, TypeError):
                        raise ValueError(f"{path}:{n}: each JSONL line must be an object with a "
                                         f"'text' field") from None
    elif path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        table = pq.read_table(path, columns=["text"])
        yield from (t for t in table.column("text").to_pylist() if t)
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def iter_texts(source: str) -> Iterator[str]:
    """The documents of a source, in a fixed order."""
    from jaxllm.corpus import builtin_corpus
    if source == "builtin":
        yield builtin_corpus()
    elif source == "stdlib":
        for path in _stdlib_files():
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
        yield builtin_corpus()
    elif source == "site":
        for _, raw in _site_documents():
            yield raw.decode("utf-8")  # valid: _site_documents checked it
    elif source.startswith("hf:"):
        parts = source[3:].split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"hf source {source!r} must be hf:NAME[:CONFIG]:SPLIT")
        try:
            import datasets
        except ImportError:
            raise ValueError("hf: sources need the datasets package: pip install datasets") from None
        ds = datasets.load_dataset(parts[0], *parts[1:-1], split=parts[-1], streaming=True)
        yield from (row["text"] for row in ds)
    elif os.path.isdir(source):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(source) for f in fs
                       if f.endswith((".txt", ".jsonl", ".parquet")))
        if not files:
            raise ValueError(f"directory {source} holds no .txt, .jsonl or .parquet files")
        for path in files:
            yield from _read_file(path)
    elif os.path.isfile(source):
        yield from _read_file(source)
    else:
        raise ValueError(f"data source {source!r} is neither a file, a directory nor one of: "
                         f"{SOURCES}")


# Encoded to fingerprint a tokenizer by what it does (two tokenizers of one name may differ).
_PROBE = "The quick brown fox, 1234567890 -- naïve café, 東京, ∑ x² \t\n  end."


def _content_key(source: str, tok: Tokenizer) -> str:
    """What the tokens depend on: each file's size, modification time and inode (a file or a
    directory's files, as read), and the tokenizer's ids for a probe text."""
    h = hashlib.sha1()
    files = [source] if os.path.isfile(source) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(source) for f in fs) \
        if os.path.isdir(source) else []
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.relpath(f, source)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}\n"
                 .encode())
    h.update(repr((tok.vocab_size, tok.eos_id, list(tok.encode(_PROBE)))).encode())
    return h.hexdigest()[:16]


def _source_key(source: str, tok: Tokenizer) -> str:
    return hashlib.sha1(f"{os.path.abspath(source) if os.path.exists(source) else source}|"
                        f"{getattr(tok, 'name', type(tok).__name__)}".encode()).hexdigest()[:16]


def token_cache_path(source: str, tok: Tokenizer, cache_dir: str) -> str:
    """Where ``tokenize`` keeps a source's tokens: keyed by the source and the tokenizer, and
    by their content (:func:`_content_key`), so an edited corpus or another tokenizer of the
    same name is tokenized again; a ``site`` source's manifest lies beside it
    (``manifest_path``)."""
    return os.path.join(cache_dir, f"tokens-{_source_key(source, tok)}-"
                                   f"{_content_key(source, tok)}.npy")


def tokenize(source: str, tok: Tokenizer, cache_dir: Optional[str] = None,
             progress: bool = False) -> np.ndarray:
    """The whole source as one token array (uint16 when the vocabulary fits), EOS between
    documents. With ``cache_dir`` the array is kept as ``.npy`` (keyed by source and tokenizer)
    and memory-mapped on later calls."""
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.int32
    path = None
    if cache_dir:
        path = token_cache_path(source, tok, cache_dir)
        if os.path.exists(path):
            return np.load(path, mmap_mode="r")
        _drop_stale(cache_dir, os.path.basename(path), source)
    from tqdm.auto import tqdm
    parts = []
    eos = [] if tok.eos_id is None else [tok.eos_id]
    # Bytes need no Python list per document (hundreds of MB for ``site``).
    if isinstance(tok, ByteTokenizer):
        encode = lambda t: np.frombuffer(t.encode("utf-8"), np.uint8)  # noqa: E731
    else:
        encode = tok.encode
    manifest = None
    if source == "site":  # read once: the manifest and the text come from the same pass
        docs = _site_documents()
        manifest = _manifest(docs)
        texts = (raw.decode("utf-8") for _, raw in docs)
    else:
        texts = iter_texts(source)
    for text in tqdm(texts, desc=f"tokenize {source}", unit="doc", disable=not progress):
        parts.append(np.concatenate([np.asarray(encode(text), dtype), np.asarray(eos, dtype)]))
    if not parts or sum(p.size for p in parts) < 2:
        raise ValueError(f"data source {source!r} holds no text")
    tokens = np.concatenate(parts)
    if path:
        tmp = f"{path}.tmp-{os.getpid()}.npy"
        try:
            os.makedirs(cache_dir, exist_ok=True)
            np.save(tmp, tokens)
            if manifest:
                with open(manifest_path(path), "w") as f:
                    json.dump(manifest, f, indent=1)
            os.replace(tmp, path)  # a reader never sees half an array
        except OSError as e:  # a read-only or full place: the run goes on from memory
            if os.path.exists(tmp):
                os.remove(tmp)
            print(f"note: the tokens of {source} are not cached ({cache_dir}: "
                  f"{e.strerror or e}); they will be tokenized again next time", file=sys.stderr)
    return tokens


def _drop_stale(cache_dir: str, name: str, source: str) -> None:
    """The tokens of an earlier version of this source (or tokenizer) go, said in one line."""
    prefix = name[:len("tokens-") + 17]  # tokens-SOURCEKEY-
    if not os.path.isdir(cache_dir):
        return
    stale = [f for f in os.listdir(cache_dir) if f.startswith(prefix) and f.endswith(".npy")]
    if stale:
        print(f"note: {source} (or its tokenizer) changed since it was tokenized: tokenizing "
              f"it again", file=sys.stderr)
    for f in stale:
        for p in (os.path.join(cache_dir, f), manifest_path(os.path.join(cache_dir, f))):
            with contextlib.suppress(OSError):
                os.remove(p)


class PackedData:
    """Fixed-length samples of a token stream in a seeded order that survives restarts.

    Sample i is tokens[i*L : i*L + L + 1] (L = seq_len). The first ``n_train`` samples are shuffled
    anew each epoch by ``default_rng([seed, epoch])``; the rest are held out. ``state()`` is the
    position (epoch, index) that ``restore`` continues from exactly.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0,
                 holdout: float = 0.0):
        self.tokens, self.L, self.B, self.seed = tokens, seq_len, batch_size, seed
        n = (len(tokens) - 1) // seq_len
        self.n_heldout = int(round(n * holdout)) if holdout else 0
        self.n_train = n - self.n_heldout
        if self.n_train < batch_size:
            raise ValueError(f"the data has {len(tokens)} tokens: {self.n_train} training samples "
                             f"of {seq_len + 1} tokens, fewer than one batch of {batch_size}; use "
                             f"more text, a shorter seq_len or a smaller batch_size")
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_train)

    def _sample(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[i * self.L:i * self.L + self.L + 1], np.int32)

    def next_batch(self) -> np.ndarray:
        """[batch_size, seq_len + 1] int32; an epoch's tail shorter than a batch is skipped."""
        if self.index + self.B > self.n_train:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        ids = self._order[self.index:self.index + self.B]
        self.index += self.B
        return np.stack([self._sample(int(i)) for i in ids])

    def heldout(self, n_tokens: int) -> np.ndarray:
        """The first ``n_tokens`` of the held-out stream (contiguous text never trained on)."""
        start = self.n_train * self.L
        if self.n_heldout == 0 or len(self.tokens) - start < n_tokens:
            raise ValueError(f"need {n_tokens} held-out tokens but only "
                             f"{max(0, len(self.tokens) - start) if self.n_heldout else 0} are "
                             f"held out; raise holdout or use more data")
        return np.asarray(self.tokens[start:start + n_tokens], np.int32)

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "n_train": self.n_train, "seq_len": self.L, "batch_size": self.B}

    def restore(self, st: dict) -> None:
        mine = self.state()
        if not isinstance(st, dict) or set(mine) - set(st):
            raise ValueError(f"the checkpoint's data position {st!r} lacks "
                             f"{sorted(set(mine) - set(st)) if isinstance(st, dict) else 'fields'}"
                             f": the checkpoint is damaged; move its step aside to resume from "
                             f"the one before, or start a new run directory")
        ep, ix = st["epoch"], st["index"]
        if not (type(ep) is int and type(ix) is int and ep >= 0 and 0 <= ix <= self.n_train
                and ix % self.B == 0):
            raise ValueError(f"the checkpoint's data position (epoch {ep!r}, index {ix!r}) is "
                             f"not one this data reaches (an index in [0, {self.n_train}] in "
                             f"steps of {self.B}): the checkpoint was edited or damaged; move "
                             f"its step aside to resume from the one before, or start a new run "
                             f"directory")
        for k in ("seed", "n_train", "seq_len", "batch_size"):
            if st[k] != mine[k]:
                raise ValueError(f"the checkpoint's data iterator had {k}={st[k]}, this run has "
                                 f"{mine[k]}: resume with the same data and settings, or start a "
                                 f"new run directory")
        self.epoch, self.index = st["epoch"], st["index"]
        self._order = self._permutation(self.epoch)
