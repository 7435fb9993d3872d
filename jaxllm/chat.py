"""A streaming chat: turn after turn through one fixed-size cache (the use case of "Efficient
Streaming Language Models with Attention Sinks", Xiao et al. 2024, §1: a multi-round dialogue
longer than the cache), each turn written in the model's chat template, the cache carried from
turn to turn, so nothing said before is encoded again.

Only the text each turn adds is encoded and fed: the template rendered for the conversation so
far is a prefix of the one rendered with the next message, so the turn's prompt is the
difference, after what the template writes behind an answer's end token.

The host drives generation (jaxllm.generate.feed_by_layer for a turn's prompt, a fixed-size chunk
at a time through one layer's program; jaxllm.generate.steps for the answer, a burst of tokens a
call: each compiled once whatever the turns' lengths), so each piece of text can be shown as it
comes and an answer can stop at a stop string.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np

# Prompt tokens per feed call: every turn's prompt goes through one program of this width. A
# call costs about the same whatever part of its width a turn fills, and a chat's turns are
# short, so the width is small (the measurements: docs/CPU.md, "A chat turn's prompt").
CHUNK = 16
# Answer tokens per call: the host looks at the answer (end token, stop strings) and shows its
# text a burst at a time. One call a token spends each call's dispatch with the machine idle
# (docs/CPU.md, "A chat's answer").
BURST = 4


class Round(NamedTuple):
    question: str
    answer: str  # the text shown: without the end token, cut before a stop string
    prompt_tokens: int  # fed this round (the template's turn around the question)
    answer_tokens: int  # generated, the end token included
    seen: int  # tokens the conversation has fed the cache so far
    held: int  # of those, what the cache holds now (sinks + the recent window)
    kv_bytes: int  # the cache's keys and values (fixed: a StreamingLLM cache does not grow)
    seconds: float = 0.0  # generating the answer, compilation left out
    stopped_by: str = ""  # "eos", "stop string", "length" or "interrupted"

    @property
    def tokens_per_s(self) -> float:
        return self.answer_tokens / self.seconds if self.seconds > 0 else 0.0


def turn_text(tok, history: list[dict], question: str, ended: bool, fed: bool = True) -> str:
    """What to feed for ``question`` after ``history`` (messages as the template takes them:
    a system message, then alternating user / assistant), the template's new turn, closing the
    last answer first (its end token, if generation stopped without it, and what the template
    writes after it). ``fed=False``: nothing of the conversation is in the cache yet, so the
    whole rendering is fed."""
    user = {"role": "user", "content": question}
    after = tok.chat(history + [user])
    if not fed:
        return after
    before = tok.chat(history, generation_prompt=False)
    if not after.startswith(before):
        raise ValueError("this chat template does not render a conversation as a prefix of its "
                         "continuation; jaxllm's streaming chat cannot feed it turn by turn")
    eos = tok.decode([tok.eos_id])
    closing = before[before.rfind(eos) + len(eos):] if eos and eos in before else ""
    return ("" if ended else eos) + closing + after[len(before):]


class _Shown:
    """The answer's text as the tokens come: what may be shown now (nothing that could still
    become a stop string, nor a half-decoded character) and where a stop string ends it."""

    def __init__(self, tok, stop: Sequence[str]):
        self.tok, self.stop, self.ids, self.shown = tok, tuple(s for s in stop if s), [], 0

    def add(self, token: int) -> tuple[str, bool]:
        """The new text to show after ``token``, and whether a stop string has appeared."""
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        hits = [text.find(s) for s in self.stop if s in text]
        if hits:
            cut = min(hits)
            new, self.shown = text[self.shown:cut], max(self.shown, cut)
            return new, True
        safe = len(text)
        if text.endswith("\ufffd"):  # a character whose bytes have not all come
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # hold back a tail that a stop string begins with
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        new = text[self.shown:max(safe, self.shown)]
        self.shown = max(safe, self.shown)
        return new, False

    def text(self, stopped: bool) -> str:
        text = self.tok.decode(self.ids)
        if stopped:
            text = text[:min(text.find(s) for s in self.stop if s in text)]
        return text


@dataclasses.dataclass(frozen=True)
class _Blank:
    """How to make one array of an empty cache again: its shape, dtype and the one value it
    holds throughout (an empty cache's arrays are fills: zeros, -1 positions), or its values."""
    shape: tuple
    dtype: np.dtype
    fill: object  # a numpy scalar, or the array itself where its values differ

    @classmethod
    def of(cls, x) -> _Blank:
        a = np.asarray(x)
        first = a.reshape(-1)[:1]
        if a.size and bool(np.all(a == first)):
            return cls(a.shape, a.dtype, first[0])
        return cls(a.shape, a.dtype, np.array(a, copy=True))

    def make(self) -> jax.Array:
        import jax.numpy as jnp
        if isinstance(self.fill, np.ndarray):
            return jnp.array(self.fill)
        return jnp.full(self.shape, self.fill, self.dtype)


class Chat:
    """One conversation with a model through ``cache`` (a StreamingLLM cache keeps it going
    forever at constant memory; a dense cache until it is full).

    ``send(message)`` feeds the new turn, generates the answer as ``sampling`` picks it
    (``max_new_tokens`` a turn; the end token and ``stop`` strings end it earlier) and returns a
    :class:`Round`; ``on_text(piece)`` receives the answer's text as it is generated. ``chunk``:
    prompt tokens per feed call (compiled programs of that width; a larger one feeds long
    prompts faster and short turns slower, see :data:`CHUNK`). ``burst``: answer tokens
    generated per call, the text shown a burst at a time (1: each token as it comes, slower;
    see :data:`BURST`).
    ``system``: a system message first (the template's default when None). ``reset()`` starts a
    new conversation in an empty cache. ``answer``: the answer's program, compiled already by
    :meth:`compile_answer` of a Chat of the same shapes (e.g. made with the weights' shapes
    before they were read).
    """

    def __init__(self, params, cfg, tok, cache, sampling=None, key: Optional[jax.Array] = None,
                 system: Optional[str] = None, stop: Sequence[str] = (), chunk: int = CHUNK,
                 burst: int = BURST, answer=None):
        from .generate import SamplingConfig
        if not getattr(tok, "has_chat_template", False):
            raise ValueError(f"{getattr(tok, 'name', 'the model')}'s tokenizer has no chat "
                             f"template (a base or byte-level model)")
        if tok.eos_id is None:
            raise ValueError("the tokenizer names no end-of-turn token; a chat needs one to "
                             "stop each answer")
        self.params, self.cfg, self.tok = params, cfg, tok
        self.sampling = dataclasses.replace(sampling or SamplingConfig(), eos_id=tok.eos_id)
        self.system, self.stop = system, tuple(stop)
        if chunk < 1:
            raise ValueError(f"chunk={chunk}: feed at least 1 prompt token a call")
        self.chunk = int(chunk)
        if burst < 1:
            raise ValueError(f"burst={burst}: generate at least 1 token a call")
        self.burst = int(burst)
        self.key = jax.random.key(0) if key is None else key
        # reset() needs the empty cache back, and the one given is donated to the first call.
        # Kept as a recipe, not as host arrays: on a CPU those are views that keep the given
        # cache's buffers alive beside the live cache (a second cache's memory, all chat long).
        self._empty = jax.tree.map(_Blank.of, cache)
        self.cache = cache
        self._answer = answer
        self._warming: Optional[threading.Thread] = None
        self._start()

    @property
    def warming(self) -> bool:
        """Whether :meth:`warm_up`'s background compile is still running."""
        return self._warming is not None and self._warming.is_alive()

    def warm_up(self) -> None:
        """Compile the programs a turn runs (or read them from the compilation cache) in a
        background thread, by running them over the chat's cache with nothing to write (a
        chunk of 0 tokens, 0 answer tokens: the cache is left as it is, and no second cache
        takes memory); :meth:`send`, :meth:`reset` and :attr:`held` wait for it. At a terminal
        the chat does this while the user types the first question, so the first answer comes
        as soon as the later ones (docs/CPU.md, "One block traced for every layer")."""
        from .generate import feed_by_layer
        from .progress import QUIET_THREAD, return_freed_memory

        def warm():
            _, key = jax.random.split(self.key)  # and the small programs send runs
            rule, none = self.sampling.rule, np.zeros((1,), np.int32)
            token, self.cache = feed_by_layer(self.params, self.cfg, rule, self.cache,
                                              np.zeros((1, self.chunk), np.int32), none, key)
            int(token[0])
            _, _, self.cache, _ = self._steps(self.cache, np.ones((1,), np.int32),
                                              np.int32(0), np.int32(-1), key)
            jax.block_until_ready(self.cache)

        def run():
            try:
                warm()
            except Exception:  # noqa: BLE001  (send compiles again and reports what fails)
                self.cache = None  # perhaps donated to the call that failed
                self.cache = self._empty_cache()
            # The programs' loads freed: glibc would keep them resident while the user types.
            return_freed_memory()

        if self._warming is None:
            # Not a daemon: a process that ends during the compile waits for it, where a daemon
            # thread torn down inside XLA aborts the interpreter's exit.
            self._warming = threading.Thread(target=run, name=QUIET_THREAD)
            self._warming.start()

    def compile_answer(self):
        """The answer's program (:func:`jaxllm.generate.steps`, the larger of a turn's
        programs) compiled for these parameters' shapes, or read from the compilation cache;
        this Chat runs it from now on, and returns it for another Chat (``answer``). The
        parameters may be ``jax.ShapeDtypeStruct`` leaves (jaxllm.load_model's ``shapes_only``):
        ``jaxllm chat`` compiles before it loads the weights, so that the program's load, which
        needs ~50 MiB more while it runs than after, comes while little else is in memory
        (docs/CPU.md, "Peak memory"); held as a program, not found in JAX's caches, it lets
        the CLI clear those of the tracing it no longer needs."""
        from .generate import steps
        row, scalar = jax.ShapeDtypeStruct((1,), np.int32), jax.ShapeDtypeStruct((), np.int32)
        self._answer = steps.lower(self.params, self.cfg, self.sampling.rule, self.burst,
                                   self.cache, row, scalar, scalar, self.key).compile()
        return self._answer

    def _steps(self, cache, token, n, eos, key):
        """generate.steps with this chat's weights and settings: its compiled program if it
        has one."""
        from .generate import steps
        if self._answer is not None:
            return self._answer(self.params, cache, token, n, eos, key)
        return steps(self.params, self.cfg, self.sampling.rule, self.burst, cache, token, n,
                     eos, key)

    def _start(self) -> None:
        self.history: list[dict] = ([{"role": "system", "content": self.system}]
                                    if self.system else [])
        self.seen, self.ended, self.fed = 0, True, False

    def _warmed(self) -> None:
        if self._warming is not None:
            self._warming.join()

    def reset(self) -> None:
        """A new conversation: the cache emptied, the history forgotten."""
        self._warmed()
        self.cache = None  # freed before its replacement is made
        self.cache = self._empty_cache()
        self._start()

    def _empty_cache(self):
        return jax.tree.map(_Blank.make, self._empty)

    @property
    def held(self) -> int:
        self._warmed()
        return int(np.max(np.asarray(self.cache.length)))

    def send(self, message: str, on_text: Optional[Callable[[str], None]] = None) -> Round:
        from .generate import feed_by_layer
        from .kv.cache import kv_bytes
        from .positions import with_sink
        from .progress import watch_compiles
        if not message.strip():
            raise ValueError("the message is empty")
        self._warmed()
        sc = self.sampling
        ids = self.tok.encode(turn_text(self.tok, self.history, message, self.ended, self.fed))
        if not self.fed and self.cfg.sink_id is not None:  # a learnable sink starts the stream
            ids = [int(t) for t in with_sink(self.cfg, np.asarray(ids, np.int32))]
        self.cache.kind.check_room(self.cache, [self.held + len(ids) + sc.max_new_tokens])
        shown = _Shown(self.tok, self.stop)
        stopped_by = "length"
        with watch_compiles() as compiling:
            t0 = time.perf_counter()
            for s in range(0, len(ids), self.chunk):  # the prompt, a fixed-size chunk at a time
                part = ids[s:s + self.chunk]
                chunk = np.zeros((1, self.chunk), np.int32)
                chunk[0, :len(part)] = part
                self.key, sub = jax.random.split(self.key)
                token, self.cache = feed_by_layer(self.params, self.cfg, sc.rule, self.cache,
                                                  chunk, np.asarray([len(part)], np.int32), sub)
            self.fed = True
            t1, c1 = time.perf_counter(), compiling[0]
            out: list[int] = []
            queue = [int(token[0])]  # sampled, not yet looked at; the last not yet written
            eos = np.int32(-1 if sc.eos_id is None else sc.eos_id)
            try:
                while True:
                    text = ""
                    for t in queue:
                        out.append(t)
                        if t == sc.eos_id:  # a burst stops at the end token
                            stopped_by = "eos"
                        else:
                            new, hit = shown.add(t)
                            text += new
                            if hit and stopped_by == "length":
                                stopped_by = "stop string"
                    left = sc.max_new_tokens - len(out)
                    last = stopped_by != "length" or left <= 0
                    # The last token is written in every case, so the cache holds every token
                    # generated (a burst's tokens after a stop string too: the history keeps
                    # them). The text is shown after the burst is dispatched: its compile never
                    # splits an answer's line.
                    toks, count, self.cache, self.key = self._steps(
                        self.cache, np.asarray(queue[-1:], np.int32),
                        np.int32(1 if last else min(self.burst, left)), eos, self.key)
                    if text and on_text is not None:
                        on_text(text)
                    if last:
                        break
                    queue = [int(t) for t in np.asarray(toks)[0, :int(count[0])]]
            except KeyboardInterrupt:
                stopped_by = "interrupted"
            jax.block_until_ready(self.cache)
            secs = max(time.perf_counter() - t1 - (compiling[0] - c1), 1e-9)
        self.ended = stopped_by == "eos"
        body = out[:-1] if self.ended else out
        answer = shown.text(stopped_by == "stop string").strip()
        # The history is what the cache holds (a stop string included), so the template's next
        # rendering continues it.
        self.history += [{"role": "user", "content": message},
                         {"role": "assistant", "content": self.tok.decode(body).strip()}]
        self.seen += len(ids) + len(out)
        return Round(message, answer, len(ids), len(out), self.seen, self.held,
                     kv_bytes(self.cache), secs, stopped_by)


def chat(params, cfg, tok, questions: list[str], cache, sampling=None,
         key: Optional[jax.Array] = None, on_round=None) -> tuple[list[Round], object]:
    """Answers to ``questions``, one round each through ``cache`` (returned at the end), as
    ``sampling`` (a SamplingConfig; default greedy, 64 tokens) picks them, each stopped at the
    tokenizer's end token. ``on_round(round)`` is called as each round finishes (to print it)."""
    c = Chat(params, cfg, tok, cache, sampling, key)
    rounds = []
    for q in questions:
        rounds.append(c.send(q))
        if on_round is not None:
            on_round(rounds[-1])
    return rounds, c.cache
