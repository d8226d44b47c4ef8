"""The matmul on oneDNN-packed weights (``kvpager_kernels/cpu/packed_gemm.cpp``)
against ``F.linear`` on the plain weight, and the checks that keep it off
weights it cannot read."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from executor_service.linear import Linear, packable
from kvpager_kernels import cpu_build, packed_gemm

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="the C++ CPU kernels did not build here")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _packed_or_skip(n, k, dtype, seed=0, bias=True):
    if not packable(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    if not packed_gemm.usable(packed, n, k, b):
        pytest.skip(f"the kernel does not serve {dtype} weights on this CPU")
    return w, b, packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 12, 13, 32, 48])
@pytest.mark.parametrize("shape", [(128, 64), (192, 96), (64, 1376), (64, 4864)])
def test_matches_f_linear(dtype, rows, shape):
    n, k = shape
    w, b, packed = _packed_or_skip(n, k, dtype, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows)).to(dtype)
    got = packed_gemm.gemm(x, packed, n, b.float())
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), packed_gemm.reference(x.float(), w.float(), b.float()), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [97, 2048])
@pytest.mark.parametrize("shape", [(192, 96), (64, 4864)])
def test_prefill_rows_match_f_linear(dtype, rows, shape):
    """A prefill step's rows: many row tiles over each panel (97 rows: 12
    tiles of 6 and 5 of 5), with k-blocks on the long K."""
    n, k = shape
    w, b, packed = _packed_or_skip(n, k, dtype, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(200 + rows)).to(dtype)
    got = packed_gemm.gemm(x, packed, n, b.float())
    torch.testing.assert_close(got.float(), packed_gemm.reference(x.float(), w.float(), b.float()), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_in_bands_when_panels_cannot_occupy_the_threads(dtype):
    """A narrow weight (2 panels) on 8 threads: 300 rows go in 8 bands, a
    32-row decode step in 2 (at least 12 rows a band), every (band, panel) a
    unit of work. Each output's sum is the same additions in the same order,
    so the product is bit-identical to one thread's (one band), over k-blocks too."""
    before = torch.get_num_threads()
    for (n, k), rows in itertools.product([(128, 96), (128, 4864)], [300, 32]):
        w, b, packed = _packed_or_skip(n, k, dtype, seed=11)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(12)).to(dtype)
        try:
            torch.set_num_threads(1)
            one = packed_gemm.gemm(x, packed, n, b.float())
            torch.set_num_threads(8)
            banded = packed_gemm.gemm(x, packed, n, b.float())
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, banded)
        torch.testing.assert_close(banded.float(), packed_gemm.reference(x.float(), w.float(), b.float()), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_blocks_sum_as_one_pass(dtype):
    """A long K is taken in blocks (fp32 past 1,024, bf16 past 2,048) with the
    sums kept in fp32 between them: the same additions in the same order as a
    short K, so the blocked product equals the fp32 reference's to rounding
    and keeps a bias added once."""
    n, k = 64, 4864
    w, b, packed = _packed_or_skip(n, k, dtype, seed=3)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    want = packed_gemm.reference(x.float(), w.float(), b.float())
    got = packed_gemm.gemm(x, packed, n, b.float()).float()
    torch.testing.assert_close(got, want, **TOL[dtype])
    # Without the bias the difference is exactly the bias: added on the first block only.
    torch.testing.assert_close(got - packed_gemm.gemm(x, packed, n).float(), b.float().expand_as(got),
                               atol=TOL[dtype]["atol"] * 4, rtol=0)


def test_without_bias_and_with_no_rows():
    w, _, packed = _packed_or_skip(128, 64, torch.float32, bias=False)
    x = torch.randn(7, 64)
    torch.testing.assert_close(packed_gemm.gemm(x, packed, 128), F.linear(x, w), **TOL[torch.float32])
    assert packed_gemm.gemm(torch.empty(0, 64), packed, 128).shape == (0, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_takes_the_kernel_up_to_max_rows(dtype):
    _packed_or_skip(128, 64, dtype)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(128, 64, generator=g).to(dtype)
    b = torch.randn(128, generator=g).to(dtype)
    lin = Linear(w, b)
    assert lin.small_rows == packed_gemm.MAX_ROWS[dtype]
    onednn = lambda x: torch.ops.mkldnn._linear_pointwise(x, lin.weight, lin.bias, "none", [], "")  # noqa: E731
    small = torch.randn(packed_gemm.MAX_ROWS[dtype], 64, generator=g).to(dtype)
    large = torch.randn(packed_gemm.MAX_ROWS[dtype] + 1, 64, generator=g).to(dtype)
    assert torch.equal(lin(small), packed_gemm.gemm(small, lin.weight, 128, b.float()))
    assert torch.equal(lin(large), onednn(large))
    torch.testing.assert_close(lin(small).float(), F.linear(small.float(), w.float(), b.float()), **TOL[dtype])


def test_weights_it_cannot_read_keep_onednn():
    if not packable(torch.float32):
        pytest.skip("oneDNN does not pack fp32 here")
    # Not whole 64-column panels: refused by size before any probe.
    odd = torch.ops.mkldnn._reorder_linear_weight(torch.randn(48, 64))
    assert not torch.ops.kvpager_cpu.packed_gemm_readable(odd, 48, 64)
    assert not packed_gemm.usable(odd, 48, 64)
    assert Linear(torch.randn(48, 64)).small_rows == 0
    # A dense tensor is read as the kernel's layout (to_panels) only when it has the weight's size and is
    # contiguous; a wrong logical shape is refused too.
    assert not torch.ops.kvpager_cpu.packed_gemm_readable(torch.randn(128, 32), 128, 64)
    assert not torch.ops.kvpager_cpu.packed_gemm_readable(torch.randn(64, 128).t(), 128, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(128, 64))
    assert not torch.ops.kvpager_cpu.packed_gemm_readable(packed, 128, 32)
    with pytest.raises(RuntimeError, match="not readable"):
        packed_gemm.gemm(torch.randn(2, 32), packed, 128)


def test_probe_refuses_a_layout_it_does_not_know():
    if not packable(torch.float32):
        pytest.skip("oneDNN does not pack fp32 here")
    # oneDNN's plain layout: the same bytes as a blocked one, other positions.
    plain = torch.randn(128, 64).to_mkldnn()
    assert torch.ops.kvpager_cpu.packed_gemm_readable(plain, 128, 64)  # the size alone cannot tell
    assert not packed_gemm.usable(plain, 128, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_a_dense_copy_in_the_kernels_layout_reads_as_the_packed_weight(dtype, rows):
    """``to_panels``: the plain weight rearranged into oneDNN's avx512_core
    layout, as a dense tensor (where oneDNN packs another way: bf16 on AMX)."""
    if not cpu_build.available() or (dtype == torch.bfloat16 and not packable(dtype)):
        pytest.skip(f"no kernel for {dtype} here")
    g = torch.Generator().manual_seed(rows)
    n, k = 192, 96
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g)
    panels = packed_gemm.to_panels(w)
    if not torch.ops.kvpager_cpu.packed_gemm_readable(panels, n, k):
        pytest.skip(f"this build has no {dtype} kernel")
    assert not torch.ops.kvpager_cpu.packed_gemm_readable(panels[:1], n, k)  # too short
    assert not torch.ops.kvpager_cpu.packed_gemm_readable(panels.transpose(0, 1), n, k)  # not contiguous
    x = torch.randn(rows, k, generator=g).to(dtype)
    got = packed_gemm.gemm(x, panels, n, b)
    torch.testing.assert_close(got.float(), packed_gemm.reference(x.float(), w.float(), b), **TOL[dtype])
    assert packed_gemm.usable(torch.ops.mkldnn._reorder_linear_weight(w), n, k, panels=panels)


def test_bf16_on_an_amx_cpu_takes_the_kernel_on_a_copy_for_every_decode_size():
    """On AMX a bf16 weight keeps a ``to_panels`` copy that the kernel serves
    for up to ``panel_rows()`` rows (every decode size where the kernel's AMX
    form runs, else 3); larger steps keep oneDNN's packed weight."""
    if not (cpu_build.available() and cpu_build.has_amx() and packable(torch.bfloat16)):
        pytest.skip("an AMX CPU's bf16 path")
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(128, 64, generator=g) / 8).to(torch.bfloat16)
    b = torch.randn(128, generator=g).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    assert not packed_gemm.usable(packed, 128, 64, b)  # oneDNN's AMX layout: never read as the kernel's
    lin = Linear(w, b)
    assert lin.small_rows == packed_gemm.panel_rows() and lin._small is not lin.weight
    assert packed_gemm.panel_rows() == (packed_gemm.MAX_ROWS[torch.bfloat16] if packed_gemm.amx_rows()
                                        else packed_gemm.AMX_BF16_MAX_ROWS)
    onednn = lambda x: torch.ops.mkldnn._linear_pointwise(x, lin.weight, lin.bias, "none", [], "")  # noqa: E731
    panels = packed_gemm.to_panels(w)
    for rows in sorted({3, 4, 19, lin.small_rows}):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        if rows <= lin.small_rows:
            assert torch.equal(lin(x), packed_gemm.gemm(x, panels, 128, b.float()))
        else:
            assert torch.equal(lin(x), onednn(x))
        torch.testing.assert_close(lin(x).float(), F.linear(x.float(), w.float(), b.float()), **TOL[torch.bfloat16])
    large = torch.randn(lin.small_rows + 1, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(lin(large), onednn(large))


@pytest.mark.parametrize("rows", [4, 5, 15, 16, 17, 32, 33, 48])
@pytest.mark.parametrize("shape", [(128, 64), (192, 96), (64, 1376), (64, 4864), (128, 80)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_amx_form_matches_f_linear_and_onednn(rows, shape, bias):
    """The kernel's AMX form (bf16 to_panels copies, 4 rows or more, K a
    multiple of 32; K = 80 keeps the vdpbf16ps form): F.linear's product to
    bf16 tolerance, and oneDNN's own AMX product to about one rounding of the
    output (only the order of the fp32 sums differs); ragged row groups."""
    if not (cpu_build.available() and packed_gemm.amx_rows() and packable(torch.bfloat16)):
        pytest.skip("the kernel's AMX form runs on AMX CPUs only")
    n, k = shape
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    got = packed_gemm.gemm(x, packed_gemm.to_panels(w), n, b)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    want = packed_gemm.reference(x.float(), w.float(), b)
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
    onednn = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w),
                                                None if b is None else b.to(torch.bfloat16), "none", [], "")
    if b is None:  # (with a bias oneDNN adds it in bf16, the kernel in fp32)
        torch.testing.assert_close(got.float(), onednn.float(), atol=2 ** -7, rtol=2 ** -7)
