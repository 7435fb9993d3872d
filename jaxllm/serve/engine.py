"""Many streams at once through one batched cache: continuous batching over a fixed pool of
rows (the use StreamingLLM was made for, Xiao et al. 2024, §1: "LLMs deployed in streaming
applications such as multi-round dialogues").

The pool is one cache of ``slots`` rows made by a streaming policy (StreamingLLM, window,
KV-quantized, H2O / Q-Hitter), each row its own stream with its own positions. Three kinds of
compiled program, each built once whatever comes and goes:

* **feed** a chunk of ``CHUNK`` prompt tokens into one row: the row taken out of the pool,
  run at batch 1 one layer's program at a time (jaxllm.model.apply_by_layer), put back (the
  cache donated), and a token sampled from its last one;
* **steps**: a burst of tokens for every row answering (up to ``burst`` steps in one call, one
  while a prompt is being fed or a request waits), rows not decoding masked (their cache
  untouched), each row sampled by its own rule (temperature, top-k, top-p, seed) on the device;
* **put**: a row replaced (an empty one for a new stream, a saved one for a session back).

So requests join and leave between steps with nothing recompiled, and a long prompt goes in a
chunk per iteration, interleaved with the steps of the rows already answering. Every row's
numbers depend on its own stream only (fixed shapes, per-row positions, masked rows never
written), so batching changes no token.

**Sessions**: a conversation keeps its row between turns, so a follow-up prefills only its new
tokens. With more sessions than rows, the least recently used idle session's row goes to host
memory and comes back on its next turn (``restored``); sessions idle past ``session_ttl`` are
dropped. Memory per session is the row's, whatever the conversation's length.

The engine is a library object with no HTTP in it (jaxllm.serve.app puts a server around it);
:meth:`Engine.run` drives it in a thread, or :meth:`Engine.iterate` one iteration at a time.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..chat import BURST, _Shown, turn_text
from ..config import ModelConfig
from ..generate import greedy
from ..model import apply, apply_by_layer
from ..positions import with_sink
from ..weight_only import loop_weights

CHUNK = 64  # prompt tokens per feed: every prompt goes through one program


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens. ``temperature`` 0 is greedy; ``top_k`` 0 and
    ``top_p`` 1 are off; ``seed`` fixes the draws (the same seed, the same tokens, whatever
    else runs at the time)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 128
    stop: tuple = ()

    def __post_init__(self):
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must lie in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= self.seed < 2 ** 31:
            raise ValueError(f"seed must lie in [0, 2^31), got {self.seed}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop takes up to 4 non-empty strings")


def sample_rows(logits: Float[Array, "b v"], temp: Float[Array, " b"], top_k: Int[Array, " b"],
                top_p: Float[Array, " b"], seed: Int[Array, " b"], count: Int[Array, " b"]
                ) -> Int[Array, " b"]:
    """Each row's token by its own rule: greedy where ``temp`` is 0, else a draw from the
    softmax of logits / temp restricted to the top-k and the top-p nucleus, keyed by the row's
    seed and its token count (so a row's draws do not depend on the other rows)."""
    pick = greedy(logits)

    def draw(_):
        x = logits / jnp.maximum(temp, 1e-6)[:, None]
        order = -jnp.sort(-x, axis=-1)  # [B, V] descending
        V = x.shape[-1]
        kth = jnp.take_along_axis(order, jnp.clip(top_k - 1, 0, V - 1)[:, None], -1)
        kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
        p = jax.nn.softmax(order, -1)
        # The nucleus: the smallest set of most likely tokens whose mass reaches top_p (a token
        # stays if the mass before it is below top_p); its least likely member's logit.
        inside = (jnp.cumsum(p, -1) - p) < top_p[:, None]
        last = jnp.sum(inside, -1, keepdims=True) - 1
        pth = jnp.take_along_axis(order, last, -1)
        keep = x >= jnp.maximum(kth, pth)
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed, count)
        drawn = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, x, -jnp.inf))
        return jnp.where(temp > 0, drawn.astype(jnp.int32), pick)

    return jax.lax.cond(jnp.any(temp > 0), draw, lambda _: pick, None)


def _row(cache, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i, 1, 0), cache)


def _put(cache, i, row):
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype),
                                                                          i, 0), cache, row)


@functools.partial(jax.jit, static_argnames=("cfg", "width"), donate_argnames=("cache",))
def steps_rows(params, cfg: ModelConfig, width: int, cache, tokens: Int[Array, " b"],
               limit: Int[Array, " b"], n: Int[Array, ""], eos: Int[Array, ""], rule: tuple
               ) -> tuple[Int[Array, "b w"], Int[Array, " b"], object]:
    """Up to ``n`` (<= ``width``) decode steps in one program: each row with ``limit`` > 0
    writes its token and samples the next, until it has sampled ``limit`` tokens or ``eos``;
    then it is masked (its cache left as it is) for the rest of the burst, as is a row whose
    ``limit`` is 0.
    Each row samples by its own rule, its k-th draw keyed by its token count + k, so a burst
    draws what one step at a time would. Returns the tokens ([B, width], a row's first
    ``count`` valid, the last of them not written yet), ``count`` and the cache.

    One call a token pays its dispatch with the machine idle (docs/CPU.md, "A chat's
    answer"); a burst pays it once."""
    B = tokens.shape[0]
    temp, top_k, top_p, seed, drawn = rule

    def body(s):
        i, tok, out, count, ended, cache = s
        p, i = loop_weights(params, i)  # else XLA widens W8/bf16 weights before the loop
        live = (count < limit) & ~ended
        logits, cache = apply(p, cfg, tok[:, None], cache, live.astype(jnp.int32))
        new = sample_rows(logits[:, 0], temp, top_k, top_p, seed, drawn + count)
        new = jnp.where(live, new, tok)
        out = jax.lax.dynamic_update_index_in_dim(out, new, i, 1)
        return i + 1, new, out, count + live, ended | (live & (new == eos)), cache

    init = (jnp.int32(0), tokens, jnp.zeros((B, width), jnp.int32), jnp.zeros((B,), jnp.int32),
            jnp.zeros((B,), bool), cache)
    _, _, out, count, _, cache = jax.lax.while_loop(
        lambda s: (s[0] < jnp.minimum(n, width)) & jnp.any((s[3] < limit) & ~s[4]), body, init)
    return out, count, cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def put_row(cache, i: Int[Array, ""], row):
    return _put(cache, i, row)


get_row = jax.jit(_row)


def feed_row(params, cfg: ModelConfig, cache, i: Int[Array, ""], tokens: Int[Array, "1 t"],
             lens: Int[Array, " 1"], rule: tuple):
    """Row ``i`` takes a chunk of tokens (``lens`` valid); a token sampled from the last. The
    row is taken out of the pool, fed one layer's program at a time (model.apply_by_layer: the
    decode burst is then the pool's only program with every layer in it) and put back; the
    pool's cache is donated."""
    logits, row = apply_by_layer(params, cfg, tokens, get_row(cache, i), lens, last_only=True)
    return _sample_first(logits, rule), put_row(cache, i, row)


@jax.jit
def _sample_first(logits: Float[Array, "1 1 v"], rule: tuple) -> Int[Array, ""]:
    return sample_rows(logits[:, 0], *rule)[0]


@dataclasses.dataclass(eq=False)
class Request:
    """One completion: the text to feed (or the chat messages), how to sample, and where its
    output goes (``emit(event)`` from the engine's thread: ``("text", piece)`` as the answer
    comes, then ``("done", Result)``, or ``("error", message)``)."""

    prompt: Optional[str] = None
    messages: Optional[list] = None
    sampling: Sampling = Sampling()
    session: Optional[str] = None
    emit: Callable = lambda event: None
    cancelled: bool = False
    # set by the engine
    ids: list = dataclasses.field(default_factory=list)
    fed: int = 0
    row: int = -1
    out: list = dataclasses.field(default_factory=list)
    shown: object = None
    restored: bool = False
    reencoded: bool = False
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    first: float = 0.0
    finish: str = ""  # why the answer ended, once it has
    cut: bool = False  # ended by a stop string (the text stops before it)

    def cancel(self) -> None:
        """Stop at the next step and free the row (a client gone)."""
        self.cancelled = True


@dataclasses.dataclass
class Result:
    text: str
    token_ids: list  # the answer's tokens (its end token included)
    prompt_tokens: int  # fed for this request (a session's follow-up: its new tokens only)
    completion_tokens: int
    finish_reason: str  # "stop" (end token or stop string), "length", "cancelled"
    session: Optional[str] = None
    restored: bool = False  # the session's row came back from host memory
    reencoded: bool = False  # the session's history did not continue: fed again from the start
    seconds: float = 0.0
    first_token_seconds: float = 0.0


@dataclasses.dataclass
class _Session:
    row: int = -1  # its row in the pool, or -1: saved on the host (``saved``) or never fed
    saved: object = None
    history: list = dataclasses.field(default_factory=list)  # the messages the cache holds
    client: list = dataclasses.field(default_factory=list)  # ... as the client was shown them
    ended: bool = True  # the last answer ended with the end token
    text_fed: bool = False  # a completion session: the stream so far is in the cache
    busy: bool = False
    used: float = dataclasses.field(default_factory=time.monotonic)


class QueueFull(Exception):
    """More requests are waiting than the engine takes: try again later."""


class Engine:
    """A pool of ``slots`` streams through ``policy``'s cache (a policy that streams and keeps
    a cache). ``submit`` queues a request (at most ``max_queue`` waiting beyond the rows free
    for them, else QueueFull); ``run`` serves until ``stop``. ``burst``: decode steps per call
    while no one waits (1: a call a token)."""

    def __init__(self, params, cfg: ModelConfig, tok, policy, slots: int = 8,
                 max_queue: int = 64, max_sessions: int = 256, session_ttl: float = 3600.0,
                 max_prompt: int = 1 << 16, burst: int = BURST):
        if not (policy.keeps_cache and policy.streams):
            raise ValueError(f"serving needs a cache that streams (streaming, window, h2o, "
                             f"qhitter), not {policy.name}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        if getattr(policy, "is_fraction", False):
            raise ValueError("eviction budgets must be counts when serving (a fraction of what? "
                             "each stream's length is open)")
        policy.check(cfg, policy.slots(0))  # e.g. learned positions cannot stream
        if tok.eos_id is None:
            raise ValueError("the tokenizer names no end token: answers would never end")
        self.params, self.cfg, self.tok, self.policy = params, cfg, tok, policy
        self.slots, self.max_queue, self.max_prompt = slots, max_queue, max_prompt
        self.burst = burst
        self.max_sessions, self.session_ttl = max_sessions, session_ttl
        self.cache = policy.make_cache(cfg, slots, 0)
        self.empty = policy.make_cache(cfg, 1, 0)
        for a in jax.tree.leaves(self.cache):  # rows are taken out and put back on axis 0
            assert a.shape[0] == slots, "every array of a cache is batch-first"
        self.rows: list[Optional[Request]] = [None] * slots
        self.owner: list[Optional[str]] = [None] * slots  # the session a row holds
        self.tokens = np.zeros(slots, np.int32)  # each decoding row's next token to write
        self.queue: collections.deque = collections.deque()
        self.sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()
        self.lock = threading.Condition()
        self.stopping = False
        self.stats = collections.Counter()
        self.timing = collections.Counter()

    # ---- the public side (any thread) -------------------------------------------------------
    def submit(self, r: Request) -> None:
        with self.lock:
            # Only what no free row will take counts as waiting: requests that arrive together
            # (or during an iteration) queue before the engine gives them their rows.
            free = sum(row is None for row in self.rows)
            if len(self.queue) - free >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFull(f"{len(self.queue) - free} requests are waiting for a row")
            self.queue.append(r)
            self.stats["requests"] += 1
            self.lock.notify()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()

    def run(self) -> None:
        """Serve until :meth:`stop`: an iteration whenever there is work."""
        while True:
            with self.lock:
                while not self.stopping and not self.queue and not any(self.rows):
                    self.lock.wait(timeout=1.0)
                    self._expire()
                if self.stopping:
                    return
            try:
                self.iterate()
            except Exception as e:  # noqa: BLE001 -- one bad iteration must not stop serving
                self._fail(e)

    def _fail(self, e: Exception) -> None:
        """Every request in a row ends with an error; their rows (and sessions) start again."""
        self.stats["engine_errors"] += 1
        for i, r in enumerate(self.rows):
            if r is not None:
                self.rows[i] = None
                self.owner[i] = None
                s = self.sessions.pop(r.session, None) if r.session is not None else None
                if s is not None:
                    self.stats["sessions_expired"] += 1
                r.emit(("error", f"the engine failed on this request: {type(e).__name__}: {e}"))
        self.cache = self.policy.make_cache(self.cfg, self.slots, 0)
        for s in self.sessions.values():
            if s.row >= 0:  # its row was remade empty
                s.row, s.history, s.client, s.text_fed = -1, [], [], False
        self.owner = [None] * self.slots

    def snapshot(self) -> dict:
        """What /metrics reports."""
        with self.lock:
            queue = len(self.queue)
        sessions = list(self.sessions.values())  # the engine's thread may change the dict
        return {"queue": queue, "rows_busy": sum(r is not None for r in list(self.rows)),
                "rows": self.slots, "sessions": len(sessions),
                "sessions_on_host": sum(s.saved is not None for s in sessions),
                **dict(self.stats), **dict(self.timing)}

    def warm_up(self) -> None:
        """Compile the pool's programs now rather than on the first request (nothing is
        written: every row's length is 0)."""
        i = np.int32(0)
        _, self.cache = feed_row(self.params, self.cfg, self.cache, i,
                                 np.zeros((1, CHUNK), np.int32), np.zeros((1,), np.int32),
                                 self._rule([None]))
        _, _, self.cache = steps_rows(self.params, self.cfg, self.burst, self.cache, self.tokens,
                                      np.zeros(self.slots, np.int32), np.int32(1),
                                      np.int32(self.tok.eos_id), self._rule(self.rows))
        jax.device_get(get_row(self.cache, i))
        self.cache = put_row(self.cache, i, self.empty)
        jax.block_until_ready(self.cache)

    # ---- one iteration (the engine's thread) -----------------------------------------------
    def iterate(self) -> None:
        """Admit what fits, feed one chunk to each row still taking its prompt, then one step
        for every row answering."""
        self._admit()
        for i, r in enumerate(self.rows):
            if r is not None and r.cancelled:
                self._finish(i, "cancelled")
        for i, r in enumerate(self.rows):
            if r is not None and r.fed < len(r.ids):
                self._feed(i, r)
        if any(r is not None and r.fed >= len(r.ids) for r in self.rows):
            self._step()

    def _admit(self) -> None:
        with self.lock:
            waiting = list(self.queue)
            self.queue.clear()
        later = []
        for r in waiting:
            if r.cancelled:  # gone before it had a row
                self.stats["finished"] += 1
                r.emit(("done", Result("", [], 0, 0, "cancelled", r.session)))
                continue
            try:
                if not self._place(r):
                    later.append(r)
            except ValueError as e:
                self.stats["errors"] += 1
                r.emit(("error", str(e)))
        with self.lock:
            self.queue.extendleft(reversed(later))

    def _free_row(self) -> int:
        """A row no request uses: an unowned one, else the least recently used idle
        session's (saved to the host first); -1 if every row is answering."""
        for i in range(self.slots):
            if self.rows[i] is None and self.owner[i] is None:
                return i
        for name, s in self.sessions.items():  # oldest first
            if s.row >= 0 and not s.busy:
                i = s.row
                s.saved, s.row = jax.device_get(get_row(self.cache, np.int32(i))), -1
                self.owner[i] = None
                self.stats["sessions_saved"] += 1
                return i
        return -1

    def _place(self, r: Request) -> bool:
        """Give ``r`` a row and its tokens to feed; False when no row is free."""
        s = None
        if r.session is not None:
            s = self.sessions.get(r.session)
            if s is not None and s.busy:
                raise ValueError(f"session {r.session!r} is answering another request")
        if s is not None and s.row >= 0:
            i = s.row
        else:
            i = self._free_row()
            if i < 0:
                return False
            if s is not None and s.saved is not None:
                self.cache = put_row(self.cache, np.int32(i), s.saved)
                s.saved, r.restored = None, True
                self.stats["sessions_restored"] += 1
            else:
                self.cache = put_row(self.cache, np.int32(i), self.empty)
        if r.session is not None and s is None:
            self._expire()
            s = self.sessions[r.session] = _Session()
            while len(self.sessions) > self.max_sessions:
                self._drop(next(iter(self.sessions)))
        try:
            r.ids = self._prompt(r, s, i)
        except ValueError:
            if s is not None and s.row < 0:
                s.row = i  # what is in row i is the session's (put back above)
                self.owner[i] = r.session
            raise
        if s is not None:
            s.row, s.busy, s.used = i, True, time.monotonic()
            self.sessions.move_to_end(r.session)
            self.owner[i] = r.session
        r.row, r.shown = i, _Shown(self.tok, r.sampling.stop)
        self.rows[i] = r
        return True

    def _prompt(self, r: Request, s: Optional[_Session], i: int) -> list:
        """The tokens ``r`` feeds into row ``i``: a session's new turn only, else everything."""
        tok = self.tok
        if r.messages is not None:
            msgs = [{"role": m["role"], "content": m["content"]} for m in r.messages]
            if not msgs or msgs[-1]["role"] != "user":
                raise ValueError("the last message must be the user's")
            fresh = s is None or not s.client
            if not fresh and msgs[:-1] != s.client:
                # The client's history is not what this session's cache holds: start again.
                self.cache = put_row(self.cache, np.int32(i), self.empty)
                r.reencoded, fresh = True, True
            text = turn_text(tok, msgs[:-1] if fresh else s.history, msgs[-1]["content"],
                             True if fresh else s.ended, fed=not fresh)
            ids = tok.encode(text)
            r.messages = msgs
        else:
            fresh = s is None or not s.text_fed
            ids = tok.encode(r.prompt)
        if fresh and self.cfg.sink_id is not None:
            ids = [int(t) for t in with_sink(self.cfg, np.asarray(ids, np.int32))]
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.max_prompt:
            raise ValueError(f"the prompt is {len(ids)} tokens, over this server's "
                             f"{self.max_prompt}")
        return ids

    def _rule(self, reqs: Sequence[Optional[Request]]) -> tuple:
        """The sampling arrays for rows holding ``reqs`` (None: a masked row)."""
        pick = lambda f, d: np.asarray([d if r is None else f(r) for r in reqs])  # noqa: E731
        return (pick(lambda r: r.sampling.temperature, 0.0).astype(np.float32),
                pick(lambda r: r.sampling.top_k, 0).astype(np.int32),
                pick(lambda r: r.sampling.top_p, 1.0).astype(np.float32),
                pick(lambda r: r.sampling.seed, 0).astype(np.int32),
                pick(lambda r: len(r.out), 0).astype(np.int32))

    def _feed(self, i: int, r: Request) -> None:
        t0 = time.perf_counter()
        part = r.ids[r.fed:r.fed + CHUNK]
        chunk = np.zeros((1, CHUNK), np.int32)
        chunk[0, :len(part)] = part
        token, self.cache = feed_row(self.params, self.cfg, self.cache, np.int32(i), chunk,
                                     np.asarray([len(part)], np.int32), self._rule([r]))
        r.fed += len(part)
        self.stats["prompt_tokens"] += len(part)
        if r.fed >= len(r.ids):  # the prompt is in: its first token is sampled
            self._take(i, r, int(token))
        self.timing["prefill_seconds"] += time.perf_counter() - t0

    def _step(self) -> None:
        """A burst for every row answering (one step while a prompt is being fed or a request
        waits for a row, so that neither waits for the burst)."""
        t0 = time.perf_counter()
        live = [r if r is not None and r.fed >= len(r.ids) else None for r in self.rows]
        # A row whose answer is over (a session's: its last token still to write) takes the
        # one step that writes it; the others up to their max_tokens.
        limit = np.asarray([0 if r is None else 1 if r.finish else
                            r.sampling.max_tokens - len(r.out) for r in live], np.int32)
        waiting = self.queue or any(r is not None and r.fed < len(r.ids) for r in self.rows)
        new, count = self._steps(limit, 1 if waiting else self.burst, live)
        self.stats["steps"] += int(count.max())
        self.stats["decode_row_steps"] += int(count.sum())
        for i, r in enumerate(live):
            if r is not None and r.finish:
                self._finish(i, r.finish)
            elif r is not None:
                for t in new[i, :count[i]]:
                    if self.rows[i] is not r:  # ended (without a session: at once)
                        break
                    self._take(i, r, int(t))
        self.timing["decode_seconds"] += time.perf_counter() - t0

    def _steps(self, limit: np.ndarray, n: int, live: Sequence[Optional[Request]]):
        new, count, self.cache = steps_rows(self.params, self.cfg, self.burst, self.cache,
                                            self.tokens, limit, np.int32(n),
                                            np.int32(self.tok.eos_id), self._rule(live))
        self.stats["decode_calls"] += 1
        return np.asarray(new), np.asarray(count)

    def _take(self, i: int, r: Request, t: int) -> None:
        """Token ``t`` sampled for row ``i``: shown (or held back while it may begin a stop
        string), and the answer's end noted. A session's last token is written by one more
        step, so its cache holds the whole answer; a request without one ends at once. A
        session's tokens after a stop string in the same burst are in its cache too: kept in
        ``out`` (the history the cache holds), not shown."""
        if not r.first:
            r.first = time.perf_counter()
        r.out.append(t)
        self.tokens[i] = t
        self.stats["completion_tokens"] += 1
        if r.finish:
            return
        if t == self.tok.eos_id:
            r.finish = "stop"
        else:
            piece, r.cut = r.shown.add(t)
            if piece:
                r.emit(("text", piece))
            if r.cut:
                r.finish = "stop"
            elif len(r.out) >= r.sampling.max_tokens:
                r.finish = "length"
        if r.finish and r.session is None:
            self._finish(i, r.finish)

    def _finish(self, i: int, reason: str) -> None:
        r = self.rows[i]
        self.rows[i] = None
        ended = bool(r.out) and r.out[-1] == self.tok.eos_id
        body = r.out[:-1] if ended else r.out
        text = r.shown.text(r.cut)
        if reason != "cancelled" and len(text) > r.shown.shown:
            # What was held back (a tail that might have begun a stop string, a character
            # whose bytes had not all come) is the answer's now: the pieces add up to the text.
            r.emit(("text", text[r.shown.shown:]))
        s = self.sessions.get(r.session) if r.session is not None else None
        if s is not None:
            s.busy, s.used = False, time.monotonic()
            if reason == "cancelled" or r.fed < len(r.ids):
                # What the row holds matches no history now: the next turn starts again.
                s.history, s.client, s.text_fed, s.row = [], [], False, -1
                self.owner[i] = None
            elif r.messages is not None:
                # The template renders what the cache holds (a stop string included); the
                # client sends back what it was shown.
                s.history = r.messages + [{"role": "assistant",
                                           "content": self.tok.decode(body).strip()}]
                s.client = r.messages + [{"role": "assistant", "content": text}]
                s.ended = ended
            else:
                s.text_fed = True
        else:
            self.owner[i] = None
        self.stats["finished"] += 1
        now = time.perf_counter()
        r.emit(("done", Result(text, list(r.out), len(r.ids), len(r.out), reason, r.session,
                               r.restored, r.reencoded, now - r.t0, (r.first or now) - r.t0)))

    def _expire(self) -> None:
        now = time.monotonic()
        for name in [n for n, s in self.sessions.items()
                     if not s.busy and now - s.used > self.session_ttl]:
            self._drop(name)

    def _drop(self, name: str) -> None:
        s = self.sessions.pop(name)
        if s.row >= 0 and self.owner[s.row] == name:
            self.owner[s.row] = None
        self.stats["sessions_expired"] += 1
