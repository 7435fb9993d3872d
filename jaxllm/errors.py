"""Errors that carry the settings they are about, so each front end names them its own way.

A library check writes the setting into its message as ``P.kv_bits`` (a marker, not a word)::

    raise SettingError(f"{P.kv_bits} {bits} is not supported by the {fmt} format")

``str(e)`` spells it as the Python API does (``kv bits``); the command line spells it as its
flag (``--kv-bits``) with :meth:`SettingError.spelled`, and ``e.params`` lists the settings.
No front end rewrites message text."""
from __future__ import annotations

import re

_MARK = "\x00{}\x00"
_FIND = re.compile("\x00(\\w+)\x00")

# How the Python API names a setting in a message (default: the field's own name).
API_NAMES = {"kv_bits": "kv bits", "kv_group": "kv group", "kv_residual": "kv residual",
             "kv_dtype": "kv dtype", "kv_quant": "kv quant", "lam": "lam (λ)"}


class _Params:
    def __getattr__(self, name: str) -> str:
        return _MARK.format(name)


P = _Params()


class SettingError(ValueError):
    """A bad value of one or more named settings (``params``)."""

    def __init__(self, message: str):
        self.template = message
        self.params = tuple(dict.fromkeys(_FIND.findall(message)))
        super().__init__(self.spelled(API_NAMES))

    def spelled(self, names: dict) -> str:
        """The message with each setting named by ``names`` (else as the API names it)."""
        return _FIND.sub(lambda m: names.get(m.group(1), API_NAMES.get(m.group(1), m.group(1))),
                         self.template)
