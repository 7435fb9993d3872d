"""The streaming chat (jaxllm/chat.py): what each round feeds is the chat template's text for the
conversation, and each answer is the greedy continuation a plain causal forward over the whole
conversation gives (no cache), while the rounds share one cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import jaxllm
from jaxllm.chat import chat, turn_text
from jaxllm.generate import SamplingConfig
from jaxllm.tokenizer import HFTokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
WORDS = ["<unk>", "<s>", "</s>", "user:", "assistant:", "\n"] + [f"w{i}" for i in range(58)]


@pytest.fixture(scope="module")
def tiny():
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", chat_template=TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": ["<s>", "</s>"]})
    tok = HFTokenizer.of(fast, "tiny")
    cfg = jaxllm.ModelConfig.llama(vocab_size=len(WORDS), hidden_size=32, num_layers=2,
                                   num_heads=4, num_kv_heads=2, intermediate_size=48)
    return cfg, jaxllm.init_params(cfg, jax.random.key(3)), tok


def test_turns_add_up_to_the_template(tiny):
    """Fed turns and generated answers (as they follow the generation prompt: " w3") make the
    template's rendering of the conversation; an answer cut off before its end token is closed
    with one."""
    _, _, tok = tiny
    history, fed, ended = [], "", True
    for q, a, stops in (("w1 w2", "w3", True), ("w4", "w5 w6", False), ("w7", "w8", True)):
        fed += turn_text(tok, history, q, ended)
        msgs = history + [{"role": "user", "content": q}]
        assert fed == tok.chat(msgs)
        fed += " " + a + ("</s>" if stops else "")
        history, ended = msgs + [{"role": "assistant", "content": a}], stops
    closing = turn_text(tok, history, "w9", ended)  # the third answer stopped: "\n" follows
    assert (fed + closing).startswith(tok.tok.apply_chat_template(history, tokenize=False))


def test_answers_are_greedy_continuations_of_the_whole_conversation(tiny):
    cfg, params, tok = tiny
    questions = ["w1 w2 w3", "w9", "w10 w11 w12 w13"]
    cache = jaxllm.init_cache(cfg, 1, sinks=0, window=256, ring=False)  # dense: nothing lost
    rounds, cache = chat(params, cfg, tok, questions, cache, SamplingConfig(max_new_tokens=6))
    seq: list[int] = []
    ended = True
    history: list = []
    for r, q in zip(rounds, questions):
        seq += tok.encode(turn_text(tok, history, q, ended))
        want = []
        for _ in range(r.answer_tokens):  # greedy, one plain forward per token
            logits, _ = jaxllm.forward(params, cfg, jnp.asarray([seq + want]))
            want.append(int(np.argmax(np.asarray(logits[0, -1]))))
            if want[-1] == tok.eos_id:
                break
        assert len(want) == r.answer_tokens
        ended = want[-1] == tok.eos_id
        assert r.answer == tok.decode(want[:-1] if ended else want).strip()
        seq += want
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.answer}]
        assert r.seen == len(seq) == r.held  # the cache holds every token fed
    assert rounds[-1].kv_bytes == 2 * 2 * 2 * 256 * 8 * 4  # k, v x layers x heads x slots x dh


def test_a_chat_needs_a_template_and_an_end_token(tiny, capsys):
    from jaxllm.cli import main
    assert main(["generate", "--model", "embedded", "--chat", "--prompt", "hi"]) == 2
    assert "has no chat template" in capsys.readouterr().err
