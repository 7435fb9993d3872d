"""Evaluations over streams (StreamingLLM §4; docs/METHODS.md §1, §6): StreamEval, passkey
retrieval and streaming QA, all scored by exact match under teacher forcing (an answer counts when
every one of its tokens is the model's argmax, i.e. greedy decoding would produce it), through any
cache policy of ``jaxllm.ppl``."""
from .common import Task, score_task
from .passkey import passkey_task
from .streameval import streameval_task

__all__ = ["Task", "passkey_task", "score_task", "streameval_task"]
