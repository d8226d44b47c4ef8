"""The CPU KV pool on transparent huge pages (executor_service/huge_pages.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from executor_service import huge_pages
from executor_service.attention import load_backend
from executor_service.huge_pages import backed_bytes, can_advise, huge_zeros, thp_mode
from executor_service.kv_pool import KvPool, head_major

MIB = 1 << 20
ADVISED = can_advise() and thp_mode() in ("always", "madvise")


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(f) == "always"
    f.write_text("garbage\n")
    assert thp_mode(f) == "unavailable"
    assert thp_mode(tmp_path / "missing") == "unavailable"


def test_huge_zeros_are_zeros_of_the_shape_and_outlive_their_mapping_object():
    t = huge_zeros((3, 1024, 1024), torch.float32)  # 12 MiB
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    gc.collect()  # the mmap object is referenced only by the tensor now
    assert int(t.count_nonzero()) == 0
    t[2, 1023, 1023] = 7.0
    t[0, 0, :4] = torch.arange(4.0)
    assert float(t.sum()) == 13.0


def test_a_small_tensor_is_plain_zeros():
    t = huge_zeros((16, 16), torch.bfloat16)
    assert t.shape == (16, 16) and t.dtype == torch.bfloat16 and int(t.count_nonzero()) == 0


@pytest.mark.skipif(not ADVISED, reason="no transparent huge pages to ask for here")
def test_huge_pages_back_an_advised_tensor_and_not_a_plain_one():
    advised = huge_zeros((8 * MIB,), torch.uint8)
    plain = torch.zeros(8 * MIB, dtype=torch.uint8)
    assert backed_bytes(advised) >= 2 * MIB  # at least one whole 2 MiB page of the 8
    if thp_mode() == "madvise":  # only advised memory gets them
        assert backed_bytes(plain) == 0


def test_backed_bytes_sums_anon_huge_pages_of_the_mappings_a_tensor_spans(tmp_path):
    t = torch.zeros(1 << 16, dtype=torch.uint8)
    lo = t.untyped_storage().data_ptr()
    hi = lo + t.untyped_storage().nbytes()
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{lo - 8192:x}-{lo + 4096:x} rw-p 00000000 00:00 0\n"          # overlaps the start
        "Size:                 12 kB\nAnonHugePages:      2048 kB\nVmFlags: rd wr mr mw me ac\n"
        f"{lo + 4096:x}-{hi + 8192:x} rw-p 00000000 00:00 0 \n"         # the rest
        "AnonHugePages:      4096 kB\n"
        f"{hi + 8192:x}-{hi + 16384:x} rw-p 00000000 00:00 0   [heap]\n"  # past the end
        "AnonHugePages:      8192 kB\n"
    )
    assert backed_bytes(t, smaps) == 6144 * 1024
    assert backed_bytes(t, tmp_path / "missing") == 0


def test_head_major_huge_is_the_same_view_as_plain():
    shape = (2, 2, 64, 16, 2, 64)  # [L, 2, NB, BS, KVH, D], 4 MiB of fp32
    a = head_major(shape, huge=True, dtype=torch.float32)
    b = head_major(shape, dtype=torch.float32, device="cpu")
    assert a.shape == b.shape == shape and a.stride() == b.stride()
    assert int(a.count_nonzero()) == 0


def test_head_major_huge_is_for_an_unpinned_cpu_pool():
    with pytest.raises(ValueError, match="unpinned CPU pool"):
        head_major((1, 2, 4, 16, 2, 64), huge=True, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match="unpinned CPU pool"):
        head_major((1, 2, 4, 16, 2, 64), huge=True, dtype=torch.float32, pin_memory=True)


def _pool(num_blocks: int, device: str = "cpu") -> KvPool:
    return KvPool(num_layers=2, num_blocks=num_blocks, block_size=16, num_kv_heads=2, head_dim=64, num_swap_blocks=4,
                  dtype=torch.float32, device=torch.device(device), backend=load_backend("torch"))


def test_the_cpu_pool_asks_for_huge_pages_and_keeps_working(monkeypatch):
    asked = []
    real = huge_pages.huge_zeros
    monkeypatch.setattr("executor_service.kv_pool.huge_zeros", lambda s, d: asked.append(s) or real(s, d))
    pool = _pool(num_blocks=256)  # 2 layers x K/V x 256 blocks x 8 KiB = 8 MiB
    assert asked == [(2, 2, 256, 2, 16, 64)]  # the device pool only, stored head-major; swap stays plain
    assert int(pool.kv.count_nonzero()) == 0
    if ADVISED:
        assert pool.kv_pool_huge_bytes() >= 2 * MIB
    k, v = pool.layer_caches()[1]
    k[5, 3, 1] = 1.5  # block 5, token 3, kv head 1
    v[7, 0, 0] = -2.0
    pool.swap_out(torch.tensor([5, 7]), torch.tensor([0, 1]))
    pool.swap_in(torch.tensor([0, 1]), torch.tensor([9, 10]))
    k, v = pool.layer_caches()[1]
    assert float(k[9, 3, 1].sum()) == 1.5 * 64 and float(v[10, 0, 0].sum()) == -2.0 * 64


@pytest.mark.parametrize("huge", [True, False])
def test_an_executor_on_a_huge_page_pool_matches_generate_and_reports_it(checkpoints, huge):
    from oracle import Oracle
    from test_executor_parts import _greedy_in_process

    from executor_service.config import ExecutorConfig
    from executor_service.executor import Executor
    from executor_service.metrics import REG

    model = checkpoints("llama_gqa")
    ex = Executor(ExecutorConfig(model=model, executor_id=f"huge-{huge}", block_size=4, device="cpu",
                                 dtype="float32", kv_cache_gib=8 / 1024, huge_pages=huge))
    assert ex.pool.kv_pool_bytes == 8 * MIB
    gauge = REG.get_sample_value("kvpager_executor_pool_huge_page_bytes", {"executor_id": f"huge-{huge}"})
    assert gauge == ex.kv_pool_huge_bytes == ex.pool.kv_pool_huge_bytes()
    if not huge:
        assert gauge == 0
    elif ADVISED:
        assert gauge >= 2 * MIB
    prompt = [5, 60, 70, 80, 90, 11, 3]
    assert _greedy_in_process(ex, prompt, 6) == Oracle(model).greedy(prompt, 6)
