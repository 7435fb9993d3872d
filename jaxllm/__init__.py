"""jaxllm: StreamingLLM, SmoothQuant and sink-token pre-training in JAX."""
from .config import PRESETS, ModelConfig, RopeScaling
from .generate import GenerateResult, SamplingConfig, generate, generate_python
from .io import load_model, save_model
from .kv import KVCache, KVQuant, init_cache
from .model import forward, init_params
from .policy import (H2O, CachePolicy, Dense, KVStorage, QHitter, Recompute, StreamingLLM,
                     Window, policy_of)
from .ppl import stream_nll
from .smoothquant import CalibConfig, quantize
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "CachePolicy", "CalibConfig", "Dense", "GenerateResult", "H2O",
           "KVCache", "KVQuant", "KVStorage", "ModelConfig", "PRESETS", "QHitter", "Recompute",
           "RopeScaling", "SamplingConfig", "StreamingLLM", "Window", "forward", "generate",
           "generate_python", "init_cache", "init_params", "load_model", "load_tokenizer",
           "policy_of", "quantize", "save_model", "stream_nll"]
