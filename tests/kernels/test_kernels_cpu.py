"""The C++ CPU kernels (``kvpager_kernels/cpu``) against their torch references:
paged attention against ``kvpager_kernels.reference`` (and the independent
contiguous SDPA; in 16-bit dtypes also transformers' eager attention), the fused layer steps against ``kvpager_kernels.fused_reference``."""

import dataclasses

import pytest
import torch

from executor_service.kv_pool import head_major
from kvpager_kernels import cpu_attention, cpu_build, fused_reference as FR, reference as R
from kvpager_kernels.testing import (contiguous_attention, drop_out_of_window, eager_attention, make_paged_batch,
                                     poison_unread)

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="the C++ CPU kernels did not build here")

MIXES = {
    "decode": ([1, 70, 9, 130, 16, 17], [1, 1, 1, 1, 1, 1]),
    "mixed": ([5, 70, 9, 33, 300], [5, 1, 3, 1, 40]),          # a 40-row chunk: in place in fp32, SDPA in 16-bit
    "prefix_hit": ([150, 20], [13, 20]),
    "long_prefill": ([90], [90]),                              # in place (8,100 pairs)
    "spec_like": ([50, 64], [16, 16]),                         # the longest query always in place
    "long_chunk": ([600, 40], [300, 40]),                      # 180,000 pairs via SDPA beside one in place
}
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _batch(mix, **kw):
    seq_lens, q_lens = MIXES[mix]
    params = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    params.update(kw)
    return make_paged_batch(seq_lens, q_lens, **params)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_attention_matches_reference(mix, group, block_size):
    batch = _batch(mix, num_heads=2 * group, block_size=block_size)
    got = cpu_attention.paged_attention(*batch.args())
    torch.testing.assert_close(got, R.paged_attention(*batch.args()), **TOL[torch.float32])
    torch.testing.assert_close(got, contiguous_attention(batch), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", ["decode", "mixed", "long_chunk"])  # in place, and gathered for SDPA
def test_attention_reads_the_executors_head_major_pool(dtype, mix):
    # The executor stores each block head-major (executor_service.kv_pool):
    # the same logical caches under other strides give the same bits.
    batch = _batch(mix, dtype=dtype, num_heads=14)
    hm = dataclasses.replace(batch, pool=head_major(batch.pool.shape, dtype=dtype).copy_(batch.pool))
    assert hm.k_cache.stride() != batch.k_cache.stride() and torch.equal(hm.pool, batch.pool)
    assert torch.equal(cpu_attention.paged_attention(*hm.args()), cpu_attention.paged_attention(*batch.args()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])  # 16/80: the generic (not 16-lane) path
def test_attention_dtypes_head_dims(dtype, head_dim):
    batch = _batch("mixed", dtype=dtype, head_dim=head_dim)
    got = cpu_attention.paged_attention(*batch.args())
    assert got.dtype == dtype and got.shape == batch.q.shape
    torch.testing.assert_close(got.float(), R.paged_attention(*batch.args()).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mix", ["decode", "prefix_hit", "long_prefill", "spec_like"])  # in place on any CPU
@pytest.mark.parametrize("head_dim", [64, 80])
def test_16bit_attention_rounds_where_transformers_rounds(dtype, mix, head_dim):
    """In a 16-bit dtype the kernel holds the scores, the scaled scores and
    the probabilities in that dtype, as transformers' eager attention does:
    its output is that attention's bit for bit but for rare rounding ties
    (fp32 sums in another order). The fp32 reference, rounded once at the
    end, differs in about half of the elements: the test tells them apart."""
    batch = _batch(mix, dtype=dtype, head_dim=head_dim)
    got = cpu_attention.paged_attention(*batch.args())
    eager = eager_attention(batch)
    same = (got == eager).float().mean().item()
    assert same >= 0.99, f"{same:.3f} of the elements as transformers' eager {dtype} attention"
    torch.testing.assert_close(got.float(), eager.float(), atol=2 ** -6, rtol=2 ** -6)
    assert (R.paged_attention(*batch.args()) == eager).float().mean().item() < 0.9


def test_plan_splits_chunks_by_work_and_dtype(monkeypatch):
    """Short queries always go in place; longer chunks while query rows x
    context stays within the dtype's budget on an AMX CPU; None keeps only
    short queries."""
    monkeypatch.setattr(cpu_build, "cpu_class", lambda: "amx")
    seq_lens, q_lens = [5, 300, 400, 600], [5, 40, 250, 300]  # pairs: 25, 12,000, 100,000, 180,000
    batch = make_paged_batch(seq_lens, q_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=torch.float32)

    def split(dtype, window=None):
        plan = cpu_attention.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16,
                                            batch.k_cache.shape[0], window, dtype)
        return plan.in_place_seqs.tolist(), [c.start for c in plan.long_chunks]

    # On AMX every dtype keeps chunks up to 256 x 256 pairs in place (65,536).
    assert split(torch.float32) == ([0, 1], [5 + 40, 5 + 40 + 250])
    assert split(torch.bfloat16) == split(torch.float16) == split(torch.float32)
    assert split(None) == ([0], [5, 45, 295])
    # a window bounds the attended context: 250 rows x (250 + 16 - 1) keys is still over budget
    assert split(torch.float32, window=16) == ([0, 1], [45, 295])
    assert split(torch.bfloat16, window=8) == ([0, 1, 2], [295])  # 250 x 257 in budget now

    # Where the bf16 tiles run on AMX (a head dim in 32s, no window), bf16
    # chunks stay in place up to AMX_TILE_PAIRS (512 x 512); the others keep
    # the budget above.
    monkeypatch.setattr(cpu_attention, "_amx_usable", lambda: True)

    def split_d(dtype, head_dim, window=None):
        plan = cpu_attention.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16,
                                            batch.k_cache.shape[0], window, dtype, head_dim)
        return plan.in_place_seqs.tolist(), [c.start for c in plan.long_chunks]

    assert split_d(torch.bfloat16, 64) == ([0, 1, 2, 3], [])
    assert split_d(torch.bfloat16, 80) == split_d(torch.float32, 64) == split(torch.float32)
    assert split_d(torch.bfloat16, 64, window=16) == split(torch.float32, window=16)
    monkeypatch.setattr(cpu_attention, "AMX_TILES", False)
    assert split_d(torch.bfloat16, 64) == split(torch.float32)
    monkeypatch.setattr(cpu_attention, "AMX_TILES", True)
    monkeypatch.setattr(cpu_attention, "_amx_usable", lambda: False)
    assert split_d(torch.bfloat16, 64) == split(torch.float32)
    assert 512 * 512 == cpu_attention.AMX_TILE_PAIRS

    # Without AMX, 16-bit SDPA has no matrix units and the kernel keeps far larger chunks.
    for cpu in ("avx512_bf16", "other"):
        monkeypatch.setattr(cpu_build, "cpu_class", lambda cpu=cpu: cpu)
        assert split(torch.bfloat16) == split(torch.float32) == ([0, 1, 2, 3], [])
        assert split(None) == ([0], [5, 45, 295])
    # Every chunk of a 2,048-token step of a 2,048-token prompt; with the pair
    # dot product a 4,096-token chunk 65,536 tokens into its context, in bf16
    # (the pair tiles in key blocks) and in fp32 (the online tiles).
    assert cpu_attention.in_place_pairs(torch.float32, "other") < 2048 * 2048 <= \
        cpu_attention.in_place_pairs(torch.bfloat16, "other")
    assert cpu_attention.in_place_pairs(torch.float32, "avx512_bf16") >= 4096 * 65536
    assert cpu_attention.in_place_pairs(torch.bfloat16, "avx512_bf16") >= 4096 * 65536


def test_cpu_class_is_read_from_the_cpu_flags(monkeypatch):
    try:
        for flags, amx, cls in (("flags : fpu avx512f avx512_bf16 amx_bf16 amx_tile", True, "amx"),
                                ("flags : fpu avx512f avx512_bf16", False, "avx512_bf16"),
                                ("flags : fpu avx2 fma", False, "other")):
            monkeypatch.setattr(cpu_build, "cpu_flags", lambda flags=flags: flags)
            cpu_build.has_amx.cache_clear()
            cpu_build.cpu_class.cache_clear()
            assert cpu_build.has_amx() is amx
            assert cpu_build.cpu_class() == cls
    finally:
        cpu_build.has_amx.cache_clear()  # this machine's answer again
        cpu_build.cpu_class.cache_clear()


def test_attention_ignores_garbage_past_each_length():
    """Slots past a sequence's length (and table padding) are never read: NaN there changes nothing."""
    batch = _batch("decode")
    want = cpu_attention.paged_attention(*batch.args())
    poison_unread(batch)
    torch.testing.assert_close(cpu_attention.paged_attention(*batch.args()), want)


def test_attention_shared_plan_and_threads():
    batch = _batch("mixed")
    plan = cpu_attention.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16,
                                        batch.k_cache.shape[0])
    want = R.paged_attention(*batch.args())
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.testing.assert_close(cpu_attention.paged_attention(*batch.args(), plan=plan), want,
                                       **TOL[torch.float32])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_prompt_in_place_matches_reference_on_any_thread_count(dtype):
    """A long prefill chunk in the kernel (work handed out last token first,
    pulled by every thread) equals the reference, a cached prefix included."""
    batch = make_paged_batch([203, 150], [203, 37], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=dtype)
    everything = cpu_attention.CpuAttentionPlan(in_place_seqs=torch.arange(2))
    want = R.paged_attention(*batch.args())
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got = cpu_attention.paged_attention(*batch.args(), plan=everything)
            torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("window, softcap", [(None, None), (33, None), (None, 20.0)])
def test_many_decodes_walk_every_kv_head_at_once_to_the_same_bits(dtype, group, head_dim, window, softcap):
    """With at least 4 decodes a thread the walk takes all kv heads of a token
    together (each block's K rows of every head in one run); with fewer, one
    kv head at a time. Head by head the arithmetic is the same: the same
    bits, equal to the reference."""
    lens = [1, 70, 9, 130, 16, 17, 300, 33, 2, 64]
    batch = make_paged_batch(lens, [1] * len(lens), num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                             block_size=16, dtype=dtype)
    if window:
        drop_out_of_window(batch, window)  # table entries before each window are never read
    plan = cpu_attention.CpuAttentionPlan(in_place_seqs=torch.arange(len(lens)), window=window)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # 10 decodes on one thread: every kv head at once
        whole = cpu_attention.paged_attention(*batch.args(), plan=plan, window=window, softcap=softcap)
        torch.set_num_threads(3)  # 3-4 a thread: a kv head at a time
        per_head = cpu_attention.paged_attention(*batch.args(), plan=plan, window=window, softcap=softcap)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole, per_head)
    want = R.paged_attention(*batch.args(), window=window, softcap=softcap)
    torch.testing.assert_close(whole.float(), want.float(), **TOL[dtype])


def test_attention_rejects_bad_tables_without_reading_them():
    batch = _batch("decode")
    bad = batch.block_tables.clone()
    bad[1, 0] = batch.k_cache.shape[0] + 5  # past the pool
    args = list(batch.args())
    args[3] = bad
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_attention.paged_attention(*args)
    short = batch.block_tables[:, :1].contiguous()  # the 130-token sequence needs 9 blocks
    args[3] = short
    with pytest.raises(RuntimeError, match="longer than its block table"):
        cpu_attention.paged_attention(*args)


# ---- fused layer steps ----------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # at most one rounding step of the 16-bit dtype apart (the fp32 sum order differs)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    _close(torch.ops.kvpager_cpu.rms_norm(x, w, 1e-6), FR.rms_norm(x, w, 1e-6), dtype)
    delta = torch.randn(7, 96, generator=g).to(dtype)
    r1, r2 = x.clone(), x.clone()
    got = torch.ops.kvpager_cpu.add_rms_norm(delta, r1, w, 1e-5)
    want = FR.add_rms_norm(delta, r2, w, 1e-5)
    assert torch.equal(r1, r2)  # the residual add rounds exactly as torch's
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv(dtype):
    g = torch.Generator().manual_seed(2)
    t, h, kvh, d, nb, bs = 5, 4, 2, 32, 6, 4
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 9, 17, 100])
    freqs = pos[:, None].float() * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.tensor([3, -1, 8, 21, 0], dtype=torch.int32)  # -1: computed, not stored
    caches = [torch.zeros(nb, bs, kvh, d, dtype=dtype) for _ in range(4)]
    pool = head_major((2, nb, bs, kvh, d), dtype=dtype)  # the executor's storage
    q1 = torch.ops.kvpager_cpu.rope_store_kv(qkv, cos, sin, h, kvh, caches[0], caches[1], slots)
    q2 = FR.rope_store_kv(qkv, cos, sin, h, kvh, caches[2], caches[3], slots)
    q3 = torch.ops.kvpager_cpu.rope_store_kv(qkv, cos, sin, h, kvh, pool[0], pool[1], slots)
    # Elementwise with torch's rounding points: bit-identical.
    assert torch.equal(q1, q2) and torch.equal(q1, q3)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(pool[0], caches[0]) and torch.equal(pool[1], caches[1])
    assert caches[0].view(-1, kvh, d)[[3, 8, 21, 0]].abs().sum() > 0


def test_rope_store_kv_rejects_slots_past_the_pool():
    qkv = torch.randn(2, 4 * 16)
    cos = sin = torch.ones(2, 16)
    k, v = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.kvpager_cpu.rope_store_kv(qkv, cos, sin, 2, 1, k, v, torch.tensor([0, 8]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(3)
    gu = (4 * torch.randn(9, 2 * 300, generator=g)).to(dtype)
    _close(torch.ops.kvpager_cpu.silu_mul(gu), FR.silu_mul(gu), dtype)


def test_bf16_silu_mul_rounds_as_torch():
    """bf16: silu rounded, times up, rounded: torch's bits for every element
    of normal-sized inputs (AVX512-BF16's conversion differs from c10's only
    for subnormal results, flushed to zero)."""
    g = torch.Generator().manual_seed(5)
    gu = (4 * torch.randn(64, 2 * 4864, generator=g)).to(torch.bfloat16)
    assert torch.equal(torch.ops.kvpager_cpu.silu_mul(gu), FR.silu_mul(gu))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_special_values(dtype):
    """NaN, infinities, signed zeros and huge values go through as torch's ops take them."""
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, 88.0, -88.0, 1e-30])
    gate = special.repeat(40)[:, None].expand(-1, 37).reshape(8, -1)  # odd widths: vector tails too
    up = torch.linspace(-3, 3, gate.numel()).reshape(gate.shape)
    gu = torch.cat([gate, up], dim=1).to(dtype)
    got, want = torch.ops.kvpager_cpu.silu_mul(gu), FR.silu_mul(gu)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.float(), want.float(), equal_nan=True,
                               **({} if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)))
