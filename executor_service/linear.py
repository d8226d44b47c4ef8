"""Linear layers of the executor's own models: the weight prepared once for
the device's fastest matmul path.

On CPU, oneDNN with the weight reordered ("packed") into its blocked layout
once at load time: for fp32 the same math as ``F.linear`` but faster on the
small row counts of decode steps (the default MKL sgemm leaves most of an
AVX-512 core idle there), for bf16 oneDNN's AVX512-BF16 / AMX kernels where
the CPU has them (``packable``), and on a CPU without bf16 instructions a
packed fp32 copy of a bf16 weight (``upcast_bf16``). On CUDA and where oneDNN
is missing, plain ``F.linear``. Steps of at most
``kvpager_kernels.packed_gemm.MAX_ROWS`` rows (decodes; in fp32 default-sized
prefill steps too) read the same packed buffer with our own kernel where it has proved
it can (``kvpager_kernels.packed_gemm``).

oneDNN builds a primitive per row count and keeps it with its buffers: fed
prefill steps of every length (17 to 2,048 rows, every third), the 30M
Llama's bf16 executor grew from 0.6 to 4.5 GB resident, and each new count
cost its first forward ~20 %. So its rows are padded to ``bucket_rows``
(16 counts an octave, at most 3 rows or 1/16 more work): 0.96 GB after the
same steps, and warm forwards within ~3 % of unpadded ones
(docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpager_kernels import packed_gemm

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


def upcast_bf16() -> bool:
    """Whether bf16 matmuls on this CPU are better done in fp32: without bf16
    instructions oneDNN cannot pack bf16, and ``F.linear`` on bf16 runs a
    slow fallback (5-10x below the packed fp32 kernel, docs/benchmarks.md)."""
    return onednn_available() and not packable(torch.bfloat16)


def bucket_rows(rows: int) -> int:
    """The row count a oneDNN matmul of ``rows`` rows runs at: rows rounded
    up to a multiple of 1/32 of their next power of two (at least 4), so at
    most 16 distinct counts per octave. (A floor of 16 padded short prefills
    by 12 % on average: 49 rows ran as 64.)"""
    if rows <= 16:
        return rows
    step = max(4, (1 << (rows - 1).bit_length()) // 32)
    return -(-rows // step) * step


class Linear:
    """``y = x @ weight.T + bias`` with the weight prepared at construction.

    weight: [N, K]; bias: [N] or None. Calls take x: [..., K] -> [..., N].

    ``mode``: "packed" (oneDNN, the weight's dtype), "upcast" (a bf16 weight
    on a CPU without bf16 instructions: kept as packed fp32, x upcast, the
    output rounded to bf16 once: the same arithmetic as a bf16 GEMM with fp32
    accumulation, at twice the weight memory) or "plain" (``F.linear``)."""

    __slots__ = ("in_features", "out_features", "weight", "bias", "mode", "dtype", "_call", "small_rows", "_bias32",
                 "_small")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        bias = None if bias is None else bias.detach().contiguous()
        on_cpu = weight.device.type == "cpu"
        if pack is False:
            self.mode = "plain"
        elif on_cpu and packable(weight.dtype):
            self.mode = "packed"
        elif on_cpu and weight.dtype == torch.bfloat16 and upcast_bf16():
            self.mode = "upcast"
        elif pack:
            raise ValueError(f"cannot pack a {weight.dtype} weight on {weight.device} here")
        else:
            self.mode = "plain"
        self.small_rows, self._bias32, self._small = 0, None, None
        if self.mode == "plain":
            self.weight, self.bias, self._call = weight.detach().contiguous(), bias, self._plain
            return
        w = weight.detach().contiguous()
        if self.mode == "upcast":
            w, bias = w.float(), None if bias is None else bias.float()
        # Opaque oneDNN tensor: the plain weight is not kept (no second copy, but bf16 on AMX below).
        self.weight, self.bias = torch.ops.mkldnn._reorder_linear_weight(w), bias
        self._call = self._onednn if self.mode == "packed" else self._upcast
        n, k = self.out_features, self.in_features
        # Rows up to which our kernel serves the weight (0 = never), and the buffer it reads.
        if packed_gemm.usable(self.weight, n, k, bias):
            self.small_rows, self._small = packed_gemm.MAX_ROWS[self.weight.dtype], self.weight
        elif self.mode == "packed" and n % 64 == 0 and packed_gemm.panels_pay(self.dtype):
            panels = packed_gemm.to_panels(w)  # oneDNN's AMX layout is not the kernel's: a copy in its own
            if packed_gemm.usable(self.weight, n, k, bias, panels=panels):
                self.small_rows, self._small = packed_gemm.panel_rows(), panels
        if self.small_rows:
            self._bias32 = None if bias is None else bias.float()

    @property
    def packed(self) -> bool:
        return self.mode != "plain"

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.small_rows and x.dim() == 2 and x.shape[0] <= self.small_rows:  # 0: the kernel never serves it
            return packed_gemm.gemm(x, self._small, self.out_features, self._bias32)
        rows = x.shape[0] if x.dim() == 2 else 0
        pad = bucket_rows(rows) - rows  # zero rows at the end; their outputs are dropped
        y = torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, pad)) if pad else x, self.weight, self.bias,
                                               "none", [], "")
        return y[:rows] if pad else y

    def _upcast(self, x: torch.Tensor) -> torch.Tensor:
        return self._onednn(x.float()).to(self.dtype)

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
