"""jaxllm: StreamingLLM, SmoothQuant and sink-token pre-training in JAX."""
from .config import PRESETS, ModelConfig, RopeScaling
from .generate import GenerateResult, SamplingConfig, generate, generate_python
from .io import load_model, save_model
from .kv import KVCache, KVQuant, init_cache
from .model import forward, init_params
from .policy import CachePolicy
from .ppl import stream_nll
from .smoothquant import CalibConfig, quantize
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "CachePolicy", "CalibConfig", "GenerateResult", "KVCache", "KVQuant",
           "ModelConfig", "PRESETS", "SamplingConfig", "forward", "generate", "generate_python", "init_cache", "init_params",
           "load_model", "load_tokenizer", "quantize", "RopeScaling", "save_model",
           "stream_nll"]
