"""Compiled Triton kernels on CUDA against the reference, at realistic sizes.

The repo-wide conftest defaults TRITON_INTERPRET to 1 (and triton fixes the
mode at import), so run these with ``TRITON_INTERPRET=0 python -m pytest
tests/kernels -m gpu`` on a CUDA machine; otherwise they skip.
"""

import pytest
import torch

import kvpager_kernels as kernels
from kvpager_kernels import reference as R
from kvpager_kernels.testing import contiguous_attention, make_paged_batch
from kvpager_kernels.triton_paged_attention import paged_attention_impl



def _compiled_on_cuda() -> bool:
    if not torch.cuda.is_available():
        return False
    from kvpager_kernels._jit import is_interpreted
    from kvpager_kernels.triton_store_kv import _store_kv_kernel

    return not is_interpreted(_store_kv_kernel)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _compiled_on_cuda(), reason="needs CUDA and TRITON_INTERPRET=0"),
]

# bf16 on GPU also rounds P to bf16 before the PV tensor-core dot.
GPU_TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def _check(batch, **kw):
    got = paged_attention_impl(*batch.args(), **kw)
    want = R.paged_attention(*batch.args())
    torch.testing.assert_close(got.float(), want.float(), **GPU_TOL[batch.q.dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_mixed_batch(dtype, head_dim, block_size):
    batch = make_paged_batch([1000, 3000, 17, 513, 2048], [200, 1, 17, 1, 1000], num_heads=32,
                             num_kv_heads=4, head_dim=head_dim, block_size=block_size,
                             dtype=dtype, device="cuda")
    _check(batch)


@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("heads", [(32, 4), (32, 32), (64, 8)])
def test_gpu_long_decode(block_size, heads):
    batch = make_paged_batch([16384, 5, 4000], [1, 1, 1], num_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=128, block_size=block_size, dtype=torch.bfloat16, device="cuda")
    got = _check(batch)
    torch.testing.assert_close(got, _check(batch, split_decode=False), **GPU_TOL[torch.bfloat16])


def test_gpu_against_independent_sdpa():
    batch = make_paged_batch([300, 64], [100, 1], num_heads=8, num_kv_heads=2, head_dim=128,
                             block_size=16, dtype=torch.float32, device="cuda")
    got = kernels.paged_attention(*batch.args())
    torch.testing.assert_close(got, contiguous_attention(batch), **GPU_TOL[torch.float32])


def test_gpu_store_and_copy():
    pool = torch.randn(4, 2, 64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    expect = pool.clone()
    key = torch.randn(100, 8, 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(64 * 16, device="cuda")[:100]
    slots[::7] = -1
    kernels.store_kv(key, value, pool[2, 0], pool[2, 1], slots)
    R.store_kv(key, value, expect[2, 0], expect[2, 1], slots)
    assert torch.equal(pool, expect)
    src = torch.arange(0, 10, device="cuda")
    dst = torch.arange(30, 40, device="cuda", dtype=torch.int32)
    kernels.copy_blocks(pool[1, 0], pool[1, 1], src, dst)
    R.copy_blocks(expect[1, 0], expect[1, 1], src, dst)
    kernels.copy_blocks_all_layers(pool, dst, src + 50)
    R.copy_blocks_all_layers(expect, dst, src + 50)
    assert torch.equal(pool, expect)
