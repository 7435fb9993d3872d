import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import jaxllm  # noqa: E402

# Tiny models: compile in about a second, big enough to exercise GQA, partial rotary, both norms.
NEOX = jaxllm.ModelConfig.gpt_neox(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                   rotary_pct=0.5)
LLAMA = jaxllm.ModelConfig.llama(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                 num_kv_heads=2, intermediate_size=48)


@pytest.fixture(scope="session", params=["neox", "llama"])
def model(request):
    cfg = NEOX if request.param == "neox" else LLAMA
    return cfg, jaxllm.init_params(cfg, jax.random.key(0))
