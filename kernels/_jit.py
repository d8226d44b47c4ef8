"""Launch-time choice between the Triton compiler and the Triton interpreter.

``triton.jit`` decides compiled-vs-interpreted when the decorator runs, i.e.
at import time. In one pytest process another module may import ``kernels``
before ``tests/kernels/conftest.py`` sets ``TRITON_INTERPRET=1``; a kernel
decorated then would be a compiled JITFunction and fail on CPU tensors.
``launch_time_jit`` instead reads ``triton.knobs.runtime.interpret`` (which
reads the environment on every access) at each launch and keeps one wrapper
of each kind.

Limitation: kernels wrapped this way must not call other jitted helpers (the
compiler would not recognise this wrapper as a JITFunction), so kernel bodies
are self-contained.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


def interpreting() -> bool:
    """True when kernels will run in the Triton interpreter (CPU tensors)."""
    return bool(triton.knobs.runtime.interpret)


class _LaunchTimeJit:
    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self._compiled: Optional[JITFunction] = None
        self._interpreted: Optional[InterpretedFunction] = None

    def _pick(self) -> Any:
        if interpreting():
            if self._interpreted is None:
                self._interpreted = InterpretedFunction(self.fn)
            return self._interpreted
        if self._compiled is None:
            self._compiled = JITFunction(self.fn)
        return self._compiled

    def __getitem__(self, grid):
        # kernel[grid](*args, CONST=...) exactly like a triton.jit function.
        return self._pick()[grid]


def launch_time_jit(fn: Callable) -> _LaunchTimeJit:
    return _LaunchTimeJit(fn)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
