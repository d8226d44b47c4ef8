"""Small helpers shared by the Triton launchers.

Compiled vs interpreted is fixed when triton is imported: ``triton.jit``
(and triton's own standard-library helpers such as ``tl.max``) read
``TRITON_INTERPRET`` at decoration time, and switching the variable later
breaks both directions (interpreted kernels cannot call compiled helpers and
vice versa). So set ``TRITON_INTERPRET=1`` before anything imports triton
(tests/conftest.py does), and ask the kernel object, not the environment,
which mode is in effect.
"""

from __future__ import annotations

from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` (a @triton.jit object) runs in the interpreter."""
    return isinstance(kernel, InterpretedFunction)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
