"""Chat templates rendered in jinja2's sandbox, with bounds on time and size.

A chat template is code from the model file (GGUF metadata, ``tokenizer_config.json``,
``chat_template.jinja``). It renders in jinja2's ``ImmutableSandboxedEnvironment`` with the
environment transformers gives templates (``trim_blocks``, ``lstrip_blocks``, loop controls, the
``{% generation %}`` block, the ``tojson`` filter and the ``raise_exception`` / ``strftime_now``
globals), so a template renders here as ``apply_chat_template`` renders it. The sandbox stops a
template reaching outside; it does not stop one from running forever or filling memory, so:

- every render has a time limit (checked as the template's Python code runs);
- ``range`` yields at most :data:`MAX_ITEMS` numbers, ``*`` and ``%`` may not build a string or
  list longer than :data:`MAX_CHARS`, no number passed to a call or a filter exceeds it (the
  value a filter is applied to aside), nor a width in a ``format`` string; ``lipsum`` is gone;
- the rendered text may not exceed :data:`MAX_CHARS` plus four times the messages' own text.

Breaking a bound, or any error in the template, is a :class:`TemplateError` (a ValueError) that
names the model and what went wrong, in one line.
"""
from __future__ import annotations

import datetime
import json
import re
import string
import sys
import time
from typing import Any, Optional

MAX_CHARS = 1 << 20  # a string, list or rendered text built by a template (beyond the messages)
MAX_ITEMS = 10_000  # numbers one ``range`` yields
TIME_LIMIT_S = 2.0  # one render


class TemplateError(ValueError):
    """A chat template that failed or broke a bound."""


class _Overrun(Exception):
    """Raised inside a render that broke a bound (turned into a TemplateError outside)."""


def _env():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's part with
        it (for training masks); rendering only needs its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "%", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _check_size(len(seq) * n, "a repetition")
            if operator == "**" and isinstance(right, int) and abs(right) > 64:
                raise _Overrun(f"a power with exponent {right}")
            if operator == "%" and isinstance(left, str):
                _check_widths(re.findall(r"%[-#0 +]*(\d*)(?:\.(\d+))?", left))
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            for v in (*args, *kwargs.values()):
                if isinstance(v, int) and not isinstance(v, bool):
                    _check_size(abs(v), "a number passed to a call")
            if (getattr(__obj, "__name__", "") in ("format", "format_map")
                    and isinstance(getattr(__obj, "__self__", None), str)):
                _check_format(__obj.__self__)
            return super().call(__context, __obj, *args, **kwargs)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def bounded_range(*args):
        r = range(*args)
        if len(r) > MAX_ITEMS:
            raise _Overrun(f"range of {len(r)} numbers (at most {MAX_ITEMS})")
        return r

    env.filters["tojson"] = tojson
    # Filters are called directly by the compiled template, not through ``call``: their numeric
    # arguments (``center(2000000000)``, ``indent``, ``batch``) get the same bound here, before
    # str.center or the like allocates in C where the time limit cannot reach.
    env.filters = {k: _bounded_filter(k, f) for k, f in env.filters.items()}
    env.globals.pop("lipsum", None)
    env.globals.update(raise_exception=raise_exception, range=bounded_range,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


def _bounded_filter(name, f):
    import functools
    skip = 2 if getattr(f, "jinja_pass_arg", None) else 1  # the context (if passed), the value

    @functools.wraps(f)  # keeps jinja_pass_arg, so jinja2 still passes the context
    def checked(*args, **kwargs):
        for v in (*args[skip:], *kwargs.values()):
            if isinstance(v, int) and not isinstance(v, bool):
                _check_size(abs(v), f"a number passed to the filter {name}")
        return f(*args, **kwargs)
    return checked


def _check_size(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise _Overrun(f"{what} of {n} (at most {MAX_CHARS})")


def _check_widths(pairs) -> None:
    for width, precision in pairs:
        for v in (width, precision):
            if v and int(v) > MAX_CHARS:
                raise _Overrun(f"a format width of {v} (at most {MAX_CHARS})")


def _check_format(fmt: str) -> None:
    """Widths and precisions in a ``str.format`` string, nested specs included."""
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec:
            _check_widths(re.findall(r"(\d+)(?:\.(\d+))?", spec) if "{" not in spec else [])
            if "{" in spec:
                _check_format(spec)


_ENV = None
_COMPILED: dict = {}


def _compiled(source: str):
    global _ENV
    if _ENV is None:
        _ENV = _env()
    if source not in _COMPILED:
        _COMPILED[source] = _ENV.from_string(source)
    return _COMPILED[source]


def render(source: str, messages: list[dict], add_generation_prompt: bool = True,
           special_tokens: Optional[dict] = None, name: str = "the model",
           time_limit: float = TIME_LIMIT_S, **extra: Any) -> str:
    """``messages`` rendered by the chat template ``source``, with the variables transformers
    passes (``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` as None, and the
    tokenizer's special tokens: ``bos_token``, ``eos_token``, ...). ``name`` names the model in
    errors."""
    import jinja2
    budget = MAX_CHARS + 4 * sum(len(str(m.get("content", ""))) for m in messages)
    variables = {"tools": None, "documents": None, **(special_tokens or {}), **extra,
                 "messages": messages, "add_generation_prompt": add_generation_prompt}
    deadline = time.monotonic() + time_limit
    ticks = [0]

    def tracer(frame, event, arg):
        ticks[0] += 1
        if ticks[0] % 256 == 0 and time.monotonic() > deadline:
            raise _Overrun(f"rendering took over {time_limit:g} s")
        return tracer

    out: list[str] = []
    size = 0
    previous = sys.gettrace()
    try:
        template = _compiled(source)
        sys.settrace(tracer)
        try:
            for piece in template.generate(**variables):
                size += len(piece)
                if size > budget:
                    raise _Overrun(f"it rendered over {budget} characters")
                out.append(piece)
        finally:
            sys.settrace(previous)
    except _Overrun as e:
        raise TemplateError(f"the chat template of {name} was stopped: {e}; the template is "
                            f"broken or hostile: use a model with a sound template") from None
    except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError,
            ZeroDivisionError, OverflowError, RecursionError, MemoryError) as e:
        raise TemplateError(f"the chat template of {name} failed: "
                            f"{type(e).__name__}: {_one_line(e)}") from None
    text = "".join(out)
    if messages and not text.strip():  # later, "the chunk is empty" would not say why
        raise TemplateError(f"the chat template of {name} renders nothing for a conversation "
                            f"of {len(messages)} message(s): the template is broken; use a model "
                            f"with a sound template")
    return text


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."
