"""Linear layers of the executor's own models: the weight prepared once for
the device's fastest matmul path.

On CPU, oneDNN with the weight reordered ("packed") into its blocked layout
once at load time: for fp32 the same math as ``F.linear`` but faster on the
small row counts of decode steps (the default MKL sgemm leaves most of an
AVX-512 core idle there), for bf16 oneDNN's AVX512-BF16 / AMX kernels where
the CPU has them (``packable``). On CUDA, where oneDNN is missing and for bf16
on a CPU without bf16 instructions, plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKABLE = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack and run a ``dtype`` weight on this CPU: fp32
    everywhere it exists; bf16 only with AVX512-BF16/AMX or AVX-NE-CONVERT
    (on a plain AVX2 CPU its reorder refuses bf16, and ``F.linear`` serves)."""
    if dtype not in PACKABLE or not onednn_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """``y = x @ weight.T + bias`` with the weight prepared at construction.

    weight: [N, K]; bias: [N] or None. Calls take x: [..., K] -> [..., N]."""

    __slots__ = ("in_features", "out_features", "weight", "bias", "packed", "_call")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().contiguous()
        if pack is None:
            pack = weight.device.type == "cpu" and packable(weight.dtype)
        self.packed = bool(pack)
        if self.packed:
            # Opaque oneDNN tensor: the plain weight is not kept (no second copy).
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
            self._call = self._onednn
        else:
            self.weight = weight.detach().contiguous()
            self._call = self._plain

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x)


def fused(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> Linear:
    """One Linear computing several that share an input, outputs concatenated
    along the last dim (q/k/v, gate/up): one matmul instead of several."""
    weight = torch.cat([w.detach() for w in weights], dim=0)
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
                          for w, b in zip(weights, biases)])
    return Linear(weight, bias)
