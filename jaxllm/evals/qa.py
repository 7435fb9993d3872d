"""Streaming QA (StreamingLLM §4.2, the ARC setting; docs/METHODS.md §1): question/answer records
concatenated into one stream, each answer scored by exact match where it occurs. The records are
the user's (a JSONL file); ``SAMPLE`` is a small synthetic set for tests and smoke runs."""
from __future__ import annotations

import json

import numpy as np

from ..config import ModelConfig
from ..policy import CachePolicy
from .common import Report, Task, build, plot_accuracy_curve, policy_result, score_task

SAMPLE = [
    {"question": "What colour is the sky on a clear day?", "choices": ["green", "blue", "red"],
     "answer": "B"},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten"],
     "answer": "B"},
    {"question": "Which is a prime number?", "choices": ["7", "8", "9"], "answer": "A"},
    {"question": "What does a thermometer measure?", "choices": ["mass", "time", "temperature"],
     "answer": "C"},
]


def read_jsonl(path: str) -> list[dict]:
    """Records ``{"question": str, "answer": str, "choices": [str, ...] (optional)}``."""
    out = []
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 (invalid byte at offset {e.start}); convert it "
                         f"first, e.g. iconv -f LATIN1 -t UTF-8") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        missing = [k for k in ("question", "answer") if not isinstance(rec.get(k), str)]
        if missing:
            raise ValueError(f"{path}:{n}: needs string fields {missing} (and optionally "
                             f"'choices', a list of strings)")
        out.append(rec)
    if not out:
        raise ValueError(f"{path} holds no records")
    return out


def qa_task(records: list[dict], encode) -> Task:
    """"Question: ...\\n(A) ... (B) ...\\nAnswer: X\\n\\n" per record, all in one stream."""
    segments = []
    for i, r in enumerate(records):
        choices = r.get("choices") or []
        opts = " ".join(f"({chr(65 + j)}) {c}" for j, c in enumerate(choices))
        segments += [(f"Question: {r['question']}\n" + (f"{opts}\n" if opts else "") + "Answer: ",
                      False, {}),
                     (r["answer"], True, {"record": i}),
                     ("\n\n", False, {})]
    return build(segments, encode)


def plot_running(correct, path: str, title: str) -> None:
    """Running exact-match accuracy over the stream's answers."""
    c = np.asarray(correct, float)
    n = np.arange(1, len(c) + 1)
    plot_accuracy_curve(n, np.cumsum(c) / n, "answer # in the stream", "running exact match",
                        path, title)


def report(params, cfg: ModelConfig, encode, pc: CachePolicy, png: str, title: str,
           records: list[dict], data: str = "sample", progress: bool = False,
           chunk: int = 256) -> Report:
    """Streaming QA of ``records`` (read from ``data``) through ``pc``: exact match per answer,
    the running accuracy plotted at ``png``."""
    task = qa_task(records, encode)
    ok = score_task(params, cfg, task, pc, progress, chunk)
    plot_running(ok, png, f"{title} · streaming QA · {pc.label}")
    return Report([f"streaming QA {pc.label}: exact match {ok.mean():.3f} over {len(ok)} "
                   f"answers, {len(task.ids)} tokens"],
                  dict(policy_result(pc), data=data, records=len(ok), tokens=int(len(task.ids)),
                       accuracy=float(ok.mean()), correct=[bool(x) for x in ok]))
