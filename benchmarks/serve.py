"""Continuous batching on the real model: the serving engine (jaxllm.serve.engine) with N
streams answering at once, against the same requests one at a time.

SmolLM2 (the packaged GGUF; the file's 4-bit blocks unless --float), a pool of --slots rows of
a StreamingLLM cache, the engine driven in this process (no HTTP), its programs compiled first.

* **Concurrency**: greedy chat answers of --tokens tokens to N different questions submitted
  together (N over the rows: the rest wait their turn). Per N: tokens/s over the whole run and
  over decode time alone, time to first token and the gap between a stream's tokens (p50 and
  p99), and whether every answer equals the same request served alone.
* **A long prompt arriving**: 4 streams answering when a --long-token prompt comes in; the
  gaps between the 4 streams' tokens while it is fed (64 tokens an iteration) and its own
  time to first token.
* **Soak**: --turns turns of one conversation through one session (the cache row kept, saved
  and restored around another session's turns every 10th turn): host memory (RSS) at the start
  and the end, and how many answers name their question's topic.

    python benchmarks/serve.py [--streams 1,4,8,16] [--tokens 64] [--slots 8] [--turns 100]
    python benchmarks/serve.py --model random:llama2-7b --slots 32 --streams 8,32 --turns 0
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import record  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.chat import BURST  # noqa: E402
from jaxllm.serve import Engine, Request, Sampling  # noqa: E402

QUESTIONS = ["Tell me about the ocean.", "What is a prime number?", "Describe a forest at dawn.",
             "How do airplanes fly?", "Write a short poem about rain.", "What is gravity?",
             "Explain what a computer does.", "Why is the sky blue?", "What is a volcano?",
             "How do bees make honey?", "What is the moon made of?", "Describe a desert.",
             "What does a heart do?", "Why do leaves fall?", "What is electricity?",
             "How do fish breathe?"]
TOPICS = [("ocean", ("ocean", "sea", "water", "wave")), ("mountain", ("mountain", "peak",
          "climb", "snow", "high")), ("music", ("music", "song", "sound", "melod", "rhythm")),
          ("bread", ("bread", "flour", "bake", "dough", "oven")), ("cat", ("cat", "pet", "feline",
          "animal", "whisker"))]


class Clock:
    """When each request's pieces of text came, and its result."""

    def __init__(self):
        self.times, self.done = {}, {}

    def request(self, k, **kw) -> Request:
        t0 = time.perf_counter()
        self.times[k] = [t0]

        def emit(ev):
            assert ev[0] != "error", ev
            if ev[0] == "text":
                self.times[k].append(time.perf_counter())
            else:
                self.done[k] = ev[1]
        return Request(emit=emit, **kw)

    def ttft(self, k) -> float:
        return self.done[k].first_token_seconds

    def gaps(self, k, since: float = 0.0, until: float = float("inf")) -> list:
        t = [x for x in self.times[k][1:] if since <= x <= until]
        return list(np.diff(t))


def ask(engine: Engine, q: str) -> dict:
    """A question as a chat message, or as plain text for a model with no chat template
    (random weights at a large model's shapes, on a GPU)."""
    if getattr(engine.tok, "has_chat_template", False):
        return {"messages": [{"role": "user", "content": q}]}
    return {"prompt": q}


def drive(engine: Engine, clock: Clock, keys) -> None:
    while any(k not in clock.done for k in keys):
        engine.iterate()


def pct(xs, q) -> str:
    return f"{np.percentile(xs, q):.2f}" if len(xs) else "-"


def concurrency(engine: Engine, a) -> list:
    alone = {}
    for i, q in enumerate(QUESTIONS[:max(a.counts)]):
        c = Clock()
        engine.submit(c.request(0, **ask(engine, q), sampling=Sampling(max_tokens=a.tokens)))
        drive(engine, c, [0])
        alone[i] = c.done[0].token_ids
    lines = ["| streams | tokens | wall s | tokens/s | decode tokens/s | first token s p50 / "
             "p99 | between tokens s p50 / p99 | same as alone |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for n in a.counts:
        c = Clock()
        dec0 = engine.timing["decode_seconds"]
        t0 = time.perf_counter()
        for i in range(n):
            engine.submit(c.request(i, **ask(engine, QUESTIONS[i]),
                                    sampling=Sampling(max_tokens=a.tokens)))
        drive(engine, c, range(n))
        secs, dec = time.perf_counter() - t0, engine.timing["decode_seconds"] - dec0
        toks = sum(c.done[i].completion_tokens for i in range(n))
        first = [c.ttft(i) for i in range(n)]
        gaps = sum((c.gaps(i) for i in range(n)), [])
        same = all(c.done[i].token_ids == alone[i] for i in range(n))
        lines.append(f"| {n} | {toks} | {secs:.2f} | {toks / secs:.1f} | {toks / dec:.1f} | "
                     f"{pct(first, 50)} / {pct(first, 99)} | {pct(gaps, 50)} / "
                     f"{pct(gaps, 99)} | {'yes' if same else 'NO'} |")
        print(lines[-1], flush=True)
    return lines


def long_prompt(engine: Engine, a) -> str:
    c = Clock()
    for i in range(4):
        engine.submit(c.request(i, **ask(engine, QUESTIONS[i]),
                                sampling=Sampling(max_tokens=10 ** 4)))
    while any(len(c.times[i]) < 4 for i in range(4)):  # all four answering
        engine.iterate()
    before = sum((c.gaps(i) for i in range(4)), [])
    text = " ".join(f"word{j % 97}" for j in range(a.long * 2))
    ids = engine.tok.encode(text)[:a.long]
    t0 = time.perf_counter()
    engine.submit(c.request("long", prompt=engine.tok.decode(ids),
                            sampling=Sampling(max_tokens=1)))
    drive(engine, c, ["long"])
    t1 = c.times["long"][0] + c.ttft("long")
    during = sum((c.gaps(i, t0, t1) for i in range(4)), [])
    for i in range(4):
        engine.rows[i] and engine.rows[i].cancel()
    drive(engine, c, range(4))
    return (f"A {c.done['long'].prompt_tokens}-token prompt arriving while 4 streams answer: "
            f"fed in {t1 - t0:.1f} s (its first token), 64 tokens an iteration; meanwhile the "
            f"4 streams' tokens came {pct(during, 50)} s apart at the median and "
            f"{pct(during, 99)} s at p99 (before it: {pct(before, 50)} / {pct(before, 99)} s).")


def rss_mib(trim: bool = False) -> float:
    """This process's resident memory; ``trim``: after the C allocator has handed back what is
    freed (glibc's malloc_trim; a saved row replaced on every save otherwise stays resident as
    free heap), so what is left is memory in use."""
    if trim:
        import gc

        from jaxllm.progress import return_freed_memory
        gc.collect()
        return_freed_memory()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def soak(engine: Engine, a) -> str:
    msgs, on_topic, rss0, restored, fed = [], 0, rss_mib(), 0, []
    rss10 = trim10 = rss0
    for turn in range(a.turns):
        topic, words = TOPICS[turn % len(TOPICS)]
        msgs.append({"role": "user", "content": f"Say one short thing about {topic}."})
        c = Clock()
        engine.submit(c.request(0, messages=list(msgs), session="soak",
                                sampling=Sampling(max_tokens=32)))
        drive(engine, c, [0])
        res = c.done[0]
        restored += res.restored
        fed.append(res.prompt_tokens)
        on_topic += any(w in res.text.lower() for w in words)
        msgs.append({"role": "assistant", "content": res.text})
        if turn % 10 == 9:  # other sessions take every row: this one goes to the host
            for j in range(engine.slots):
                c2 = Clock()
                engine.submit(c2.request(0, prompt="Hello", session=f"other{j}",
                                         sampling=Sampling(max_tokens=2)))
                drive(engine, c2, [0])
        if turn == 9:
            rss10, trim10 = rss_mib(), rss_mib(trim=True)
    return (f"Soak: {a.turns} turns of one session (StreamingLLM keeps its row at "
            f"{engine.cache.capacity} slots however long it gets; "
            f"{sum(fed)} prompt tokens fed in all, {int(np.median(fed))} a turn at the median, "
            f"the first "
            f"{fed[0]}), restored from host memory {restored} times: host RSS {rss0:.0f} MiB "
            f"before, {rss10:.0f} after 10 turns, {rss_mib():.0f} after {a.turns}; in use (RSS "
            f"after malloc_trim) {trim10:.0f} MiB after 10 turns, {rss_mib(trim=True):.0f} after "
            f"{a.turns}; "
            f"{on_topic} of {a.turns} answers name their topic (a keyword check).")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="smollm2, or random:PRESET (a large model's shapes on a GPU)")
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--burst", type=int, default=BURST,
                    help=f"decode steps per call while no request waits (default {BURST})")
    ap.add_argument("--float", action="store_true", help="float32 weights (default: the "
                                                         "file's 4-bit blocks)")
    ap.add_argument("--parts", default="concurrency,long,soak",
                    help="which of concurrency, long, soak to run (soak is recorded apart)")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    a.counts = [int(x) for x in a.streams.split(",")]
    blocks = a.model == "smollm2" and not a.float
    cfg, params, tok = jaxllm.load_model(a.model, keep_quantized=blocks)
    engine = Engine(params, cfg, tok, jaxllm.StreamingLLM(4, a.cache), slots=a.slots,
                    max_prompt=max(a.long, 4096), burst=a.burst)
    engine.warm_up()
    parts = a.parts.split(",")
    weights = "the file's 4-bit blocks (Q4_1, Q8_0 embedding)" if blocks else "float32"
    setup = (f"jaxllm.serve.Engine in one process, {a.slots} rows of StreamingLLM "
             f"4+{a.cache - 4}, weights {weights}, bursts of {a.burst} decode steps a call")
    if "concurrency" in parts:
        lines = concurrency(engine, a)
        notes = [long_prompt(engine, a)] if "long" in parts else []
        record(f"Serving: concurrent streams ({a.model}, {'4-bit' if blocks else 'float32'}, "
               f"{a.slots} rows)", "\n".join(lines),
               f"{setup}; greedy chat answers of up to {a.tokens} tokens to different questions "
               f"submitted together (over {a.slots}: queued). 'decode tokens/s': over the time "
               f"in decode steps alone; 'between tokens': the gaps between a stream's pieces of "
               f"text (a burst's tokens come as one piece); 'same as alone': every answer's "
               f"tokens equal the same request served by itself.\n\n" + "\n\n".join(notes),
               dry=a.no_record)
    if "soak" in parts and a.turns and getattr(tok, "has_chat_template", False):
        note = soak(engine, a)
        record(f"Serving: a {a.turns}-turn session ({a.model})", note, f"{setup}.",
               dry=a.no_record)


if __name__ == "__main__":
    main()
