"""A task is a token stream with marked answer spans; scoring streams it once through a cache
policy and checks each span by exact match."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from ..config import ModelConfig
from ..policy import CachePolicy
from ..ppl import stream_score


class Report(NamedTuple):
    """What an evaluation reports, beside the figure it wrote: ``lines`` for the terminal and
    ``result``, the numbers for its JSON."""

    lines: list
    result: dict


def policy_result(pc: CachePolicy) -> dict:
    """The policy a streamed evaluation ran through, for its JSON."""
    return {"method": pc.name, "label": pc.label, "sinks": pc.sinks,
            "cache": getattr(pc, "cache", None)}


@dataclasses.dataclass
class Task:
    """``ids``: the whole stream; ``spans``: (start, end) token ranges of answers, each predicted
    from everything before it; ``meta``: one dict per span (what the report groups by)."""

    ids: np.ndarray
    spans: list[tuple[int, int]]
    meta: list[dict]


def build(segments: Sequence[tuple[str, bool, dict]], encode) -> Task:
    """Concatenate text segments (``is_answer`` marks the spans) encoded one by one, so span
    boundaries are exact token boundaries."""
    ids, spans, meta = [], [], []
    for text, is_answer, m in segments:
        piece = encode(text)
        if is_answer:
            if not piece:
                raise ValueError(f"answer {text!r} encodes to no tokens")
            spans.append((len(ids), len(ids) + len(piece)))
            meta.append(m)
        ids += piece
    return Task(np.asarray(ids, np.int32), spans, meta)


def exact_matches(hit: np.ndarray, spans) -> np.ndarray:
    """``hit[i]``: token i+1 was the argmax after tokens 0..i. A span [s, e) matches when all of
    hit[s-1 .. e-2] hold."""
    return np.asarray([bool(hit[s - 1:e - 1].all()) for s, e in spans])


def score_task(params, cfg: ModelConfig, task: Task, pc: CachePolicy,
               progress: bool = False, chunk: int = 256) -> np.ndarray:
    """Exact match of every answer span of ``task`` streamed through ``pc``'s cache policy."""
    if not task.spans:
        raise ValueError("the task has no answers to score; make the stream longer")
    if task.spans[0][0] < 1:
        raise ValueError("an answer cannot start the stream: it needs a prefix")
    _, hit = stream_score(params, cfg, task.ids, pc, progress, desc=f"eval {pc.name}",
                          chunk=chunk)
    return exact_matches(hit, task.spans)


def plot_accuracy_curve(x, y, xlabel: str, ylabel: str, path: str, title: str) -> None:
    """One accuracy curve in [0, 1] (StreamEval by length, QA running accuracy)."""
    from ..plots import figure
    with figure(path, title, size=(6, 3.2)) as ax:
        ax.plot(x, y, marker="o" if len(x) < 50 else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.05, 1.05)
