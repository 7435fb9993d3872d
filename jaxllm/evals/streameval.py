"""StreamEval (StreamingLLM §4.3, Fig. 9; docs/METHODS.md §1): a stream of register lines,
"The REGISTER_CONTENT in line {i} is <{5 digits}>.", with a query after every ``every`` new lines
about the line ``lookback`` lines back. The query repeats that line's format, so the answer is
the 5 digits; it is scored by exact match and then stays in the stream, as text would."""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..policy import CachePolicy
from .common import Report, Task, build, plot_accuracy_curve, policy_result, score_task

LINE = "The REGISTER_CONTENT in line {i} is <{value}>.\n"


def streameval_task(n_lines: int, encode, seed: int = 0, every: int = 10,
                    lookback: int = 20) -> Task:
    """``n_lines`` register lines with queries interleaved; span meta: line, asked, position."""
    if n_lines < lookback or every < 1 or lookback < 1:
        raise ValueError(f"need n_lines >= lookback ({lookback}) and every, lookback >= 1")
    rng = np.random.default_rng(seed)
    values = [f"{v:05d}" for v in rng.integers(0, 100_000, n_lines)]
    segments = []
    for i in range(n_lines):
        segments.append((LINE.format(i=i, value=values[i]), False, {}))
        if (i + 1) % every == 0 and i + 1 >= lookback:
            j = i + 1 - lookback  # lookback lines back from the next line
            segments += [(f"The REGISTER_CONTENT in line {j} is <", False, {}),
                         (values[j], True, {"line": i + 1, "asked": j}),
                         (">.\n", False, {})]
    return build(segments, encode)


def accuracy_by_length(task: Task, matches: np.ndarray, bucket: int) -> list[dict]:
    """Exact-match accuracy of the queries whose answer starts in each ``bucket``-token slice."""
    out = {}
    for (s, _), ok in zip(task.spans, matches):
        b = s // bucket
        n, k = out.get(b, (0, 0))
        out[b] = (n + 1, k + int(ok))
    return [{"start": b * bucket, "end": (b + 1) * bucket, "queries": n, "accuracy": k / n}
            for b, (n, k) in sorted(out.items())]


def plot_accuracy(rows: list[dict], path: str, title: str) -> None:
    """Exact-match accuracy against input length (Fig. 9)."""
    plot_accuracy_curve([r["end"] for r in rows], [r["accuracy"] for r in rows],
                        "input length (tokens)", "exact-match accuracy", path, title)


def report(params, cfg: ModelConfig, encode, pc: CachePolicy, png: str, title: str,
           n_lines: int = 400, bucket: int = 2000, seed: int = 0, progress: bool = False,
           chunk: int = 256) -> Report:
    """StreamEval through ``pc``: accuracy per ``bucket`` tokens of input, plotted at ``png``."""
    task = streameval_task(n_lines, encode, seed)
    ok = score_task(params, cfg, task, pc, progress, chunk)
    rows = accuracy_by_length(task, ok, bucket)
    plot_accuracy(rows, png, f"{title} · StreamEval · {pc.label}")
    return Report([f"StreamEval {pc.label}: accuracy {ok.mean():.3f} over {len(ok)} queries, "
                   f"{len(task.ids)} tokens"],
                  dict(policy_result(pc), tokens=int(len(task.ids)), queries=len(ok),
                       accuracy=float(ok.mean()), by_length=rows))
