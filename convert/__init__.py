"""Checkpoint converters: Hugging Face <-> jaxllm (no torch needed, no remote code, no pickle
unless asked). Model directories and orbax checkpoints are ``jaxllm.save_model`` /
``jaxllm.load_model``."""
from .families import EXPORTABLE, SUPPORTED, UnsupportedModel, config_from_hf, config_to_hf
from .hf import from_hf, is_hf_dir, to_hf

__all__ = ["EXPORTABLE", "SUPPORTED", "UnsupportedModel", "config_from_hf", "config_to_hf",
           "from_hf", "is_hf_dir", "to_hf"]
