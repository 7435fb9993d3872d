"""Per-layer parity with transformers: one norm, one MLP, one attention layer and one decoder
block, each fed the same random input with the weights of a transformers module (converted by
``convert.from_hf``), so a mismatch points at its layer rather than at "the logits differ"
(levanter's tests/test_llama.py does the same)."""
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import transformers as tf  # noqa: E402

import convert  # noqa: E402
from jaxllm import attention  # noqa: E402
from jaxllm.model import MLP, Attention, Block, Norm  # noqa: E402
from jaxllm.rope import inv_freq  # noqa: E402

B, T = 2, 11
VARIANTS = {  # GQA with biases and scaled RoPE (Llama 3), where the frequencies matter
    "llama3-gqa-bias": dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                            rope_parameters=dict(rope_type="llama3", factor=4.0,
                                                 low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=4,
                                                 rope_theta=10000.0)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def llama(request):
    torch.manual_seed(0)
    hf_cfg = tf.LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1,
                            num_attention_heads=4, intermediate_size=96, initializer_range=0.2,
                            **VARIANTS[request.param])
    model = tf.LlamaForCausalLM(hf_cfg).eval()
    cfg, params = convert.from_hf(model)
    x = np.random.default_rng(0).standard_normal((B, T, 64)).astype(np.float32)
    return model, cfg, params["layer_0"], x


def _hf_inputs(model, x):
    """The rotary tables and the causal additive mask transformers' eager attention takes."""
    h = torch.from_numpy(x)
    pos = torch.arange(T)[None].expand(B, T)
    rope = model.model.rotary_emb(h, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
    return h, pos, rope, mask


def _plan(cfg):
    freq = inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, jnp.full((B,), T))
    return attention.plain.plan(cfg, B, T, freq)


def _close(ours, theirs, what):
    np.testing.assert_allclose(np.asarray(ours), theirs.detach().numpy(), atol=2e-5, rtol=1e-4,
                               err_msg=what)


def test_rmsnorm(llama):
    model, cfg, p, x = llama
    ours = Norm(cfg.norm, cfg.norm_eps, cfg.norm_bias).apply({"params": p["ln_attn"]}, x)
    _close(ours, model.model.layers[0].input_layernorm(torch.from_numpy(x)), "input_layernorm")


def test_mlp(llama):
    model, cfg, p, x = llama
    ours = MLP(cfg).apply({"params": p["mlp"]}, x)
    _close(ours, model.model.layers[0].mlp(torch.from_numpy(x)), "mlp")


def test_attention(llama):
    model, cfg, p, x = llama
    h, _, rope, mask = _hf_inputs(model, x)
    ours, _ = Attention(cfg).apply({"params": p["attn"]}, x, None, _plan(cfg))
    with torch.no_grad():
        theirs = model.model.layers[0].self_attn(h, position_embeddings=rope,
                                                 attention_mask=mask)[0]
    _close(ours, theirs, "self_attn")


def test_decoder_block(llama):
    model, cfg, p, x = llama
    h, pos, rope, mask = _hf_inputs(model, x)
    ours, _ = Block(cfg).apply({"params": p}, x, None, _plan(cfg))
    with torch.no_grad():
        theirs = model.model.layers[0](h, attention_mask=mask, position_ids=pos,
                                       position_embeddings=rope)
    _close(ours, theirs[0] if isinstance(theirs, tuple) else theirs, "decoder layer")


def test_a_wrong_weight_is_caught_at_its_layer(llama):
    """The tests above can fail: a transposed o_proj breaks attention and the block, not the
    norm or the MLP."""
    model, cfg, p, x = llama
    h, _, rope, mask = _hf_inputs(model, x)
    bad = dict(p["attn"], o=dict(p["attn"]["o"], kernel=p["attn"]["o"]["kernel"].T))
    ours, _ = Attention(cfg).apply({"params": bad}, x, None, _plan(cfg))
    with torch.no_grad():
        theirs = model.model.layers[0].self_attn(h, position_embeddings=rope,
                                                 attention_mask=mask)[0]
    assert np.abs(np.asarray(ours) - theirs.numpy()).max() > 1e-2
