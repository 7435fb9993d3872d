"""Serving many endless conversations at once: :mod:`.engine` (a pool of cache rows,
continuous batching, sessions that keep their cache; no HTTP) and :mod:`.app` (an
OpenAI-compatible server around it, ``jaxllm serve``)."""
from .app import make_app
from .engine import CHUNK, Engine, QueueFull, Request, Result, Sampling

__all__ = ["CHUNK", "Engine", "QueueFull", "Request", "Result", "Sampling", "make_app"]
