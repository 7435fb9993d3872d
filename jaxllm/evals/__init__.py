"""The evaluations, each with its report (the terminal lines, the JSON result and the figure:
``report(...) -> Report``; the ``jaxllm eval`` command only maps its flags onto them).

Over streams (StreamingLLM §4; docs/METHODS.md §1, §6): StreamEval, passkey retrieval and
streaming QA, all scored by exact match under teacher forcing (an answer counts when every one of
its tokens is the model's argmax, i.e. greedy decoding would produce it), through any cache
policy (jaxllm.policy). Over a model: attention sinks (``attention``), activation outliers before
and after smoothing (``outliers``), heavy hitters under KV quantization (``kv_shift``)."""
from .common import Task, score_task
from .passkey import passkey_task
from .streameval import streameval_task

__all__ = ["Task", "passkey_task", "score_task", "streameval_task"]
