"""The executor's prepared Linear: packed where oneDNN serves the dtype on
this CPU, plain otherwise, and the same numbers as ``F.linear`` either way."""

import pytest
import torch
import torch.nn.functional as F

from executor_service.linear import Linear, fused, packable


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_linear_matches_f_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(rows, 32, generator=g).to(dtype)
    lin = Linear(w, b)
    assert lin.packed == packable(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(lin(x).float(), F.linear(x, w, b).float(), rtol=tol, atol=tol)


def test_bf16_packing_follows_the_cpu():
    # oneDNN's bf16 reorder needs AVX512-BF16/AMX or AVX-NE-CONVERT: elsewhere the weight stays plain.
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    assert packable(torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert packable(torch.float32)
    assert not packable(torch.float16)


def test_fused_concatenates_outputs():
    w1, w2 = torch.randn(8, 16), torch.randn(4, 16)
    b1 = torch.randn(8)
    x = torch.randn(3, 16)
    out = fused([w1, w2], [b1, None])(x)
    torch.testing.assert_close(out, torch.cat([F.linear(x, w1, b1), F.linear(x, w2)], dim=-1), rtol=1e-5, atol=1e-5)
