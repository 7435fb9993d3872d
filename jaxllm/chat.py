"""A streaming chat: question after question through one fixed-size cache (the use case of
"Efficient Streaming Language Models with Attention Sinks", Xiao et al. 2024, §1: a multi-round
dialogue longer than the cache), each turn written in the
model's chat template, the cache carried from round to round (jaxllm.generate returns it).

Only the text each round adds is encoded and fed: the template rendered for the conversation so
far is a prefix of the one rendered with the next question, so the round's prompt is the
difference, after what the template writes behind an answer's end token.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np


BUCKET = 64  # prompt lengths are padded to a multiple of this


class Round(NamedTuple):
    question: str
    answer: str
    prompt_tokens: int  # fed this round (the template's turn around the question)
    answer_tokens: int  # generated, the end token included
    seen: int  # tokens the conversation has fed the cache so far
    held: int  # of those, what the cache holds now (sinks + the recent window)
    kv_bytes: int  # the cache's keys and values (fixed: a StreamingLLM cache does not grow)


def turn_text(tok, history: list[dict], question: str, ended: bool) -> str:
    """What to feed for ``question`` after ``history`` (alternating user/assistant messages,
    the answers as decoded): the template's new turn, closing the last answer first (its end
    token, if generation stopped without it, and what the template writes after it)."""
    user = {"role": "user", "content": question}
    after = tok.chat(history + [user])
    if not history:
        return after
    before = tok.chat(history, generation_prompt=False)
    if not after.startswith(before):
        raise ValueError("this chat template does not render a conversation as a prefix of its "
                         "continuation; jaxllm's streaming chat cannot feed it turn by turn")
    eos = tok.decode([tok.eos_id])
    closing = before[before.rfind(eos) + len(eos):] if eos and eos in before else ""
    return ("" if ended else eos) + closing + after[len(before):]


def chat(params, cfg, tok, questions: list[str], cache, sampling=None,
         key: Optional[jax.Array] = None, on_round=None) -> tuple[list[Round], object]:
    """Answers to ``questions``, one round each through ``cache`` (returned at the end), as
    ``sampling`` (a SamplingConfig; default greedy, 64 tokens) picks them, each stopped at the
    tokenizer's end token. ``on_round(round)`` is called as each round finishes (to print it)."""
    import dataclasses

    from .kv.cache import kv_bytes
    from .generate import SamplingConfig, generate
    if tok.eos_id is None:
        raise ValueError("the tokenizer names no end-of-turn token; a chat needs one to stop "
                         "each answer")
    sc = dataclasses.replace(sampling or SamplingConfig(), eos_id=tok.eos_id)
    history: list[dict] = []
    rounds, seen, ended = [], 0, True
    key = jax.random.key(0) if key is None else key
    for q in questions:
        key, sub = jax.random.split(key)
        ids = tok.encode(turn_text(tok, history, q, ended))
        # Right-padded to a multiple of BUCKET: rounds of similar length share one compiled
        # loop (its shapes are the prompt's), instead of one compile per round.
        padded = np.zeros((1, -(-len(ids) // BUCKET) * BUCKET), np.int32)
        padded[0, :len(ids)] = ids
        res = generate(params, cfg, jnp.asarray(padded), cache, sc, sub,
                       prompt_lengths=jnp.asarray([len(ids)], jnp.int32))
        cache = res.cache
        n = int(res.num_tokens[0])
        out = [int(t) for t in np.asarray(res.tokens[0, :n])]
        ended = bool(out) and out[-1] == tok.eos_id
        answer = tok.decode(out[:-1] if ended else out).strip()
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]
        seen += len(ids) + n
        r = Round(q, answer, len(ids), n, seen, int(np.max(np.asarray(cache.length))),
                  kv_bytes(cache))
        rounds.append(r)
        if on_round is not None:
            on_round(r)
    return rounds, cache
