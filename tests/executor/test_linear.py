"""The executor's prepared Linear: packed where oneDNN serves the dtype on
this CPU, plain otherwise, and the same numbers as ``F.linear`` either way."""

import pytest
import torch
import torch.nn.functional as F

from executor_service.linear import Linear, bucket_rows, fused, packable, upcast_bf16


def expected_mode(dtype):
    if packable(dtype):
        return "packed"
    return "upcast" if dtype == torch.bfloat16 and upcast_bf16() else "plain"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 150, 160, 2100])  # 150, 2100: oneDNN on rows padded to a bucket
def test_linear_matches_f_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(rows, 32, generator=g).to(dtype)
    lin = Linear(w, b)
    assert lin.mode == expected_mode(dtype)
    assert lin(x).dtype == dtype and lin(x).shape == (rows, 48) and lin(x).is_contiguous()
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


def test_upcast_rounds_once_like_a_bf16_gemm():
    # The fp32 product of bf16 inputs, rounded to bf16 once: what a bf16 GEMM with fp32 accumulation gives.
    if not upcast_bf16():
        pytest.skip("this CPU packs bf16 natively (no upcast path)")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g).bfloat16()
    b = torch.randn(64, generator=g).bfloat16()
    x = torch.randn(9, 96, generator=g).bfloat16()
    lin = Linear(w, b)
    assert lin.mode == "upcast"
    ref = (x.double() @ w.double().T + b.double()).to(torch.bfloat16)
    out = lin(x)
    # accumulation order may move a value across a rounding boundary: at most one bf16 ulp
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
    assert (out == ref).float().mean() > 0.9


def test_pack_refused_where_impossible():
    if packable(torch.float16):
        pytest.skip("fp16 packs here")
    with pytest.raises(ValueError, match="cannot pack"):
        Linear(torch.randn(4, 4).half(), pack=True)


def test_a_weight_the_kernel_does_not_serve_never_reaches_it(monkeypatch):
    """No C++ kernels (KVPAGER_CPU_KERNELS=0, no compiler) or a weight its probe
    refused: every step goes to oneDNN, a step with no rows too (a prefill chunk
    that samples nothing sends the vocabulary projection 0 rows)."""
    from kvpager_kernels import packed_gemm

    if not packable(torch.float32):
        pytest.skip("oneDNN does not pack fp32 weights here")
    monkeypatch.setattr(packed_gemm, "usable", lambda *a, **k: False)

    def never(*a, **k):
        raise AssertionError("the packed-weight kernel was called for a weight it does not serve")

    monkeypatch.setattr(packed_gemm, "gemm", never)
    w = torch.randn(48, 32)
    lin = Linear(w)
    assert lin.mode == "packed" and lin.small_rows == 0
    for rows in (0, 1, 5):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(lin(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_onednn_row_counts_come_in_at_most_sixteen_buckets_an_octave():
    """A oneDNN matmul builds (and keeps) a primitive and its buffers per row
    count: prefill steps of every length made a bf16 executor's memory grow
    by gigabytes (docs/benchmarks.md). Rows are padded to a bucket: at most
    16 per octave, at most 3 rows or 1/16 more work (short prefills are not
    padded by much: a 49-row step runs as 52, not 64)."""
    assert [bucket_rows(r) for r in (0, 1, 16)] == [0, 1, 16]
    for rows in range(17, 9000):
        b = bucket_rows(rows)
        assert rows <= b <= rows + max(3, rows // 16), rows
        assert bucket_rows(b) == b
    assert [bucket_rows(r) for r in (49, 65, 100, 130, 136, 257)] == [52, 68, 100, 136, 136, 272]
    for lo in (64, 128, 256, 512, 1024, 2048, 4096):
        assert len({bucket_rows(r) for r in range(lo + 1, 2 * lo + 1)}) == 16
    assert len({bucket_rows(r) for r in range(17, 2049)}) == 92
