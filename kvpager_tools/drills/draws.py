"""Seeded random value generators for the fuzz drill, edge-biased.

A small strategy algebra in the shape of the property-testing libraries
(``integers``, ``lists``, ``one_of``, ``composite`` …) on a plain
``random.Random``: the drill ships with kvpager and must not need a test-only
package. Every strategy draws boundary values more often than a uniform
draw would (range ends, NaN, infinities, empty and full lists), which is
where services break.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable, Sequence
from typing import Any

_EDGE = 0.2  # probability of a boundary value where a strategy has boundaries


class Strategy:
    def __init__(self, draw: Callable[[random.Random], Any]) -> None:
        self._draw = draw

    def draw(self, rng: random.Random) -> Any:
        return self._draw(rng)

    def map(self, fn: Callable[[Any], Any]) -> Strategy:
        return Strategy(lambda rng: fn(self._draw(rng)))

    def __or__(self, other: Strategy) -> Strategy:
        return one_of(self, other)


def just(value: Any) -> Strategy:
    return Strategy(lambda rng: value)


def booleans() -> Strategy:
    return Strategy(lambda rng: rng.random() < 0.5)


def integers(lo: int, hi: int) -> Strategy:
    def draw(rng: random.Random) -> int:
        if rng.random() < _EDGE:
            return rng.choice((lo, hi, min(hi, lo + 1), max(lo, hi - 1)))
        return rng.randint(lo, hi)
    return Strategy(draw)


def floats(*, allow_nan: bool = True, allow_infinity: bool = True, width: int = 64) -> Strategy:
    edges = [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 3.4e38, -3.4e38]
    if allow_nan:
        edges.append(math.nan)
    if allow_infinity:
        edges += [math.inf, -math.inf]

    def draw(rng: random.Random) -> float:
        if rng.random() < 2 * _EDGE:
            return rng.choice(edges)
        x = rng.uniform(-4.0, 4.0) * 10 ** rng.randint(-6, 6)
        if width == 32:  # representable in the proto's float
            x = struct.unpack("f", struct.pack("f", max(-3.4e38, min(3.4e38, x))))[0]
        return x
    return Strategy(draw)


def sampled_from(values: Sequence[Any]) -> Strategy:
    values = list(values)
    return Strategy(lambda rng: rng.choice(values))


def one_of(*strategies: Strategy) -> Strategy:
    return Strategy(lambda rng: rng.choice(strategies).draw(rng))


def lists(elements: Strategy, *, min_size: int = 0, max_size: int = 8, unique: bool = False) -> Strategy:
    def draw(rng: random.Random) -> list:
        n = rng.choice((min_size, max_size)) if rng.random() < _EDGE else rng.randint(min_size, max_size)
        out: list = []
        tries = 0
        while len(out) < n and tries < 10 * n + 10:
            tries += 1
            x = elements.draw(rng)
            if unique and x in out:
                continue
            out.append(x)
        return out
    return Strategy(draw)


def dictionaries(keys: Strategy, values: Strategy, *, max_size: int = 8) -> Strategy:
    """Dicts of up to max_size entries (distinct keys: a repeated key is drawn again)."""
    pairs = lists(keys, max_size=max_size, unique=True)
    return Strategy(lambda rng: {k: values.draw(rng) for k in pairs.draw(rng)})


def tuples(*strategies: Strategy) -> Strategy:
    return Strategy(lambda rng: tuple(s.draw(rng) for s in strategies))


def builds(fn: Callable[..., Any], *strategies: Strategy) -> Strategy:
    return Strategy(lambda rng: fn(*(s.draw(rng) for s in strategies)))


_TEXT = "abc xyz.é\x00\n\t☃\ud7ff\U0001f600"


def text(*, min_size: int = 0, max_size: int = 16) -> Strategy:
    def draw(rng: random.Random) -> str:
        n = rng.randint(min_size, max_size)
        return "".join(rng.choice(_TEXT) if rng.random() < 0.5 else chr(rng.randint(32, 0x2FFF))
                       for _ in range(n))
    return Strategy(draw)


def binary(*, max_size: int = 16) -> Strategy:
    return Strategy(lambda rng: rng.randbytes(rng.randint(0, max_size)))


def composite(fn: Callable[..., Any]) -> Callable[..., Strategy]:
    """``@composite def s(draw, *args)``: ``s(*args)`` is a strategy; ``draw(strategy)`` inside draws."""
    def make(*args, **kwargs) -> Strategy:
        return Strategy(lambda rng: fn(lambda s: s.draw(rng), *args, **kwargs))
    return make
