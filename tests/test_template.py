"""Chat templates (jaxllm/template.py): rendered as transformers renders them, and a hostile
template (endless loops, huge strings, lipsum) stopped with one TemplateError instead of hanging
or filling memory. The real model's template is checked against transformers in test_gguf."""
import pytest

from jaxllm.template import TemplateError, render

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <there>"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2 + 2?"}]

# Features real templates use: loop controls, tojson, raise_exception, generation blocks,
# special tokens, whitespace control.
TEMPLATES = [
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{{ bos_token }}{% for m in messages %}{{ m | tojson }}\n"
    "{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}",
    "{%- for m in messages -%}\n  {%- if m.role == 'assistant' -%}\n"
    "    {% generation %}{{ m.content }}{% endgeneration %}\n  {%- else -%}\n"
    "    [{{ m.role | upper }}] {{ m.content }}\n  {%- endif %}\n{% endfor -%}",
]


@pytest.mark.parametrize("source", TEMPLATES)
@pytest.mark.parametrize("prompt", [True, False])
def test_renders_as_transformers(source, prompt):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2},
                                                    unk_token="<unk>")),
        unk_token="<unk>", bos_token="<s>", eos_token="</s>", chat_template=source)
    want = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=prompt)
    assert render(source, MSGS, prompt, special_tokens=tok.special_tokens_map) == want


HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                    "{% endfor %}",
    "a long loop": "{% for i in range(10000) %}{% for j in range(10000) %}{{ '' }}{% endfor %}"
                   "{% endfor %}",
    "string repetition": "{{ 'x' * 2000000000 }}",
    "list repetition": "{{ ([1] * 2000000000) | length }}",
    "lipsum": "{{ lipsum(1000000) }}",
    "format width": "{{ '{:>2000000000}'.format(1) }}",
    "percent width": "{{ '%2000000000d' % 1 }}",
    "center": "{{ 'x' | center(2000000000) }}",
    "indent": "{{ 'x\ny' | indent(width=2000000000) }}",
    "output": "{% for i in range(9000) %}{{ 'y' * 1000 }}{% endfor %}",
    "power": "{{ 10 ** 100000000 }}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "error": "{{ raise_exception('no chats here') }}",
    "syntax": "{% for m in messages %}",
    "undefined call": "{{ messages.nope() }}",
    "renders nothing": "{% for m in messages %}{% endfor %}  ",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_is_one_error(name):
    with pytest.raises(TemplateError) as e:
        render(HOSTILE[name], MSGS, name="evil.gguf")
    msg = str(e.value)
    assert "\n" not in msg and "evil.gguf" in msg and len(msg) < 400, msg


def test_the_bounds_leave_real_conversations_alone():
    """A long conversation (300 turns of 2,000 characters) renders whole: the output bound grows
    with the messages."""
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "w " * 1000}
            for i in range(300)]
    out = render(TEMPLATES[0], long, special_tokens={"eos_token": "</s>"})
    assert out.count("</s>") == 300 and len(out) > 600_000
