"""Pre-training of Pythia-style models with and without a sink token (docs/METHODS.md §2).

``TrainConfig`` (one frozen recipe), ``train()`` (the sharded, checkpointed, resumable loop),
``python -m train run|plot`` (the CLI) and ``python -m train.experiments.sink_token`` (vanilla vs
zero sink vs learnable sink, the paper's Table 3 and Fig. 6/7).
"""
from .config import RECIPES, TrainConfig, recipe
from .loop import train

__all__ = ["RECIPES", "TrainConfig", "recipe", "train"]
