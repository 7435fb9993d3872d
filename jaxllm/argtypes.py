"""The kinds of number a command-line flag takes, each defined once: ``integer(lo, hi)`` and
``real(lo, hi)``. Used as argparse types, they validate where the flag is parsed: a value that
is not a number of the kind, not finite, or out of range is refused in one line that gives the
range, before any work (counts and lengths never exceed int32, so no array is ever built from
one that overflows). Cross-flag rules (``--cache`` above ``--sinks``) stay with the commands."""
from __future__ import annotations

import argparse
import math

from .config import INT32_MAX


class integer:
    """An integer in [lo, hi] (decimal digits, an optional sign)."""

    def __init__(self, lo: int = 0, hi: int = INT32_MAX):
        self.lo, self.hi = lo, hi
        self.__name__ = "integer"  # argparse names the type in some messages

    def __call__(self, text: str) -> int:
        t = text.strip()
        body = t[1:] if t[:1] in "+-" else t
        if not (body.isascii() and body.isdigit()):
            raise argparse.ArgumentTypeError(f"expected an integer in [{self.lo}, {self.hi}], "
                                             f"got {text!r}")
        if len(body.lstrip("0")) > 20:  # far out of any range (and int() of 4,300+ digits fails)
            raise argparse.ArgumentTypeError(f"{text.strip()[:24]}... is out of range: an "
                                             f"integer in [{self.lo}, {self.hi}]")
        v = int(t)
        if not self.lo <= v <= self.hi:
            raise argparse.ArgumentTypeError(f"{v} is out of range: an integer in "
                                             f"[{self.lo}, {self.hi}]")
        return v

    def __repr__(self) -> str:
        return f"integer({self.lo}, {self.hi})"


class real:
    """A finite number in [lo, hi] (``lo_open``/``hi_open``: the end excluded)."""

    def __init__(self, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False,
                 hi_open: bool = False):
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open
        self.__name__ = "number"

    def range(self) -> str:
        return (f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.hi_open else ']'}")

    def __contains__(self, v: float) -> bool:
        return (math.isfinite(v) and (v > self.lo if self.lo_open else v >= self.lo)
                and (v < self.hi if self.hi_open else v <= self.hi))

    def __call__(self, text: str) -> float:
        try:
            v = float(text)
        except (ValueError, TypeError):
            raise argparse.ArgumentTypeError(f"expected a number in {self.range()}, got "
                                             f"{text!r}") from None
        if v not in self:
            raise argparse.ArgumentTypeError(f"{text.strip()} is out of range: a finite number "
                                             f"in {self.range()}")
        return v

    def __repr__(self) -> str:
        return f"real{self.range()}"


def is_budget(x: float) -> bool:
    """A budget of tokens: a count (an integer in [0, int32]) or a fraction in (0, 1) of the
    text (jaxllm.policy.H2O's heavy/recent take these)."""
    return math.isfinite(x) and (0 < x < 1 or (x == int(x) and 0 <= x <= INT32_MAX))


class budget:
    """A flag that takes a budget (:func:`is_budget`)."""

    __name__ = "budget"

    def __call__(self, text: str) -> float:
        try:
            x = float(text)
        except (ValueError, TypeError):
            x = math.nan
        if not is_budget(x):
            raise argparse.ArgumentTypeError(f"expected a count (integer >= 0) or a fraction in "
                                             f"(0, 1), got {text!r}")
        return x

    def __repr__(self) -> str:
        return "budget"


class listof:
    """Comma-separated values of one kind (``integer``, ``real`` ...), at most ``most`` of them,
    each checked as that kind is."""

    def __init__(self, kind, most: int = 64):
        self.kind, self.most = kind, most
        self.__name__ = f"list of {getattr(kind, '__name__', 'value')}s"

    def __call__(self, text: str) -> tuple:
        parts = [t for t in text.split(",")]
        if len(parts) > self.most:
            raise argparse.ArgumentTypeError(f"at most {self.most} comma-separated values, got "
                                             f"{len(parts)}")
        out = []
        for t in parts:
            try:
                out.append(self.kind(t))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"in {text[:40]!r}: {e}") from None
        return tuple(out)

    def __repr__(self) -> str:
        return f"listof({self.kind!r})"


COUNT = integer(1)  # how many of something: at least one
SIZE = integer(0)  # a size or budget where 0 means none (or all, as the flag says)
FRACTION = real(0.0, 1.0)
BUDGET = budget()
