"""jaxllm: StreamingLLM, SmoothQuant and sink-token pre-training in JAX."""
import os as _os

# jaxllm uses transformers for tokenizers only: its advice that PyTorch is missing (printed on
# every import without torch) reads as a fault to a jaxllm user.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from .config import PRESETS, ModelConfig, RopeScaling
from .generate import GenerateResult, SamplingConfig, generate, generate_python
from .io import load_model, save_model
from .kinds import init_cache
from .kv import KVCache, KVQuant
from .model import forward, init_params
from .policy import (H2O, CachePolicy, Dense, KVStorage, QHitter, Recompute, StreamingLLM,
                     Window, policy_of)
from .ppl import stream_nll
from .smoothquant import CalibConfig, quantize
from .tokenizer import ByteTokenizer, load_tokenizer


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("jaxllm")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0.1.0+checkout"


__version__ = _version()

__all__ = ["ByteTokenizer", "CachePolicy", "CalibConfig", "Dense", "GenerateResult", "H2O",
           "KVCache", "KVQuant", "KVStorage", "ModelConfig", "PRESETS", "QHitter", "Recompute",
           "RopeScaling", "SamplingConfig", "StreamingLLM", "Window", "forward", "generate",
           "generate_python", "init_cache", "init_params", "load_model", "load_tokenizer",
           "policy_of", "quantize", "save_model", "stream_nll"]
