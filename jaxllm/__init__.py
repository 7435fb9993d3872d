"""jaxllm: StreamingLLM, SmoothQuant and sink-token pre-training in JAX."""
from .cache import KVCache, init_cache
from .config import PRESETS, ModelConfig
from .model import forward, init_params

__all__ = ["KVCache", "ModelConfig", "PRESETS", "forward", "init_cache", "init_params"]
