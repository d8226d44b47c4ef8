"""The draw of a sampled token: the exponential race (Gumbel-max trick) over
counter-based uniforms.

Row r (a sampled token) has a key, ``row_keys(seed, position, index)``;
token t of it the uniform ``u = ((splitmix64(key ^ t) >> 11) + 0.5) * 2^-53``
(``token_uniforms``), and the row draws the token maximising
``log_p[t] - log(-log(u))``: an exact sample of ``softmax(log_p)``, a pure
function of (seed, position, token), whatever else shares the batch.

``reference_gumbel_argmax`` is that formula in torch ops, ``[N, V]`` int64
and float64 tensors a pass each; ``gumbel_argmax`` answers it on the C++
kernel (``kvpager_kernels/cpu/gumbel.cpp``: one pass, everything in
registers) for CPU fp32 rows, and by the reference elsewhere.
"""

from __future__ import annotations

import torch

from kvpager_kernels import cpu_build

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser over int64 tensors (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """[N] int64 each: one key per sampled token."""
    return splitmix64(splitmix64(splitmix64(seeds) ^ positions) ^ sample_index)


def token_uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys [N] -> uniforms in (0, 1), [N, vocab_size] float64."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)  # [V]
    bits = splitmix64(keys[:, None] ^ token_ids[None, :])  # [N, V]
    return (_shr(bits, 11).to(torch.float64) + 0.5) * (2.0**-53)


def reference_gumbel_argmax(log_p: torch.Tensor, keys: torch.Tensor,
                            token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """log_p [N, V], keys [N] -> [N] int64: the token of the first entry
    maximising log_p - log(-log(u)) in float64. Entry t is token t, or
    ``token_ids[:, t]`` ([N, V] int64: a row sorted by top-k / top-p)."""
    u = token_uniforms(keys, log_p.shape[-1])
    if token_ids is not None:
        u = u.gather(1, token_ids)
    at = (log_p.double() - torch.log(-torch.log(u))).argmax(dim=-1)
    return at if token_ids is None else token_ids.gather(1, at[:, None])[:, 0]


def gumbel_argmax(log_p: torch.Tensor, keys: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``reference_gumbel_argmax``'s draw, on the C++ kernel where it runs (CPU
    fp32 log_p with contiguous rows). With ``token_ids`` the rows must come in
    descending order, dropped tokens (-inf) last: the kernel stops at the
    first of them. The kernel's logarithm is fdlibm's, not torch's: the two
    may differ in the last bit, which changes a draw only where two tokens'
    scores tie to ~1e-16."""
    if (log_p.device.type == "cpu" and log_p.dim() == 2 and log_p.dtype == torch.float32
            and log_p.size(1) > 0 and log_p.stride(1) == 1 and keys.dtype == torch.int64
            and (token_ids is None or (token_ids.dtype == torch.int64 and token_ids.stride(-1) == 1))
            and cpu_build.available()):
        return torch.ops.kvpager_cpu.gumbel_argmax(log_p, keys, token_ids)
    return reference_gumbel_argmax(log_p, keys, token_ids)
