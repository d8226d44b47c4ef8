"""fp32 and bf16 prefill chunks attended in tiles
(kvpager_kernels/cpu/attention_tiles.h) against the per-query walk of the same
C++ kernel, kvpager_kernels.reference and (bf16) transformers' eager attention."""

import pytest
import torch

from kvpager_kernels import cpu_attention, cpu_build, reference as R
from kvpager_kernels.testing import contiguous_attention, eager_attention, make_paged_batch, poison_unread

pytestmark = pytest.mark.skipif(not cpu_build.available() or "avx512f" not in cpu_build.cpu_flags().split(),
                                reason="the tile kernel is built for AVX-512 CPUs")

TOL = dict(atol=2e-5, rtol=2e-5)
TILE_MIN_QUERY = cpu_attention.TILE_MIN_QUERY  # the product's settings (tests patch the module's)
ONLINE_MIN_KEYS, ONLINE_MIN_ROWS = cpu_attention.ONLINE_MIN_KEYS, cpu_attention.ONLINE_MIN_ROWS


def _both(batch, monkeypatch, **kw):
    """(tiled, walked) outputs of the in-place kernel for every sequence."""
    got = {}
    assert TILE_MIN_QUERY >= 1
    for name, min_query in (("tiled", TILE_MIN_QUERY), ("walked", 0)):
        monkeypatch.setattr(cpu_attention, "TILE_MIN_QUERY", min_query)
        plan = cpu_attention.CpuAttentionPlan(in_place_seqs=torch.arange(batch.seq_lens.numel()),
                                              window=kw.get("window"))
        got[name] = cpu_attention.paged_attention(*batch.args(), plan=plan, **kw)
    return got["tiled"], got["walked"]


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
def test_tiles_match_the_walk_and_the_reference(monkeypatch, group, head_dim):
    # 37 tokens: two full tiles and a ragged one; 3 tokens x 7 heads = 21 rows
    # (a padded row vector); a cached prefix; a decode that stays walked.
    batch = make_paged_batch([37, 50, 9, 64], [37, 3, 1, 20], num_heads=2 * group, num_kv_heads=2,
                             head_dim=head_dim, block_size=16)
    tiled, walked = _both(batch, monkeypatch)
    torch.testing.assert_close(tiled, walked, **TOL)
    torch.testing.assert_close(tiled, R.paged_attention(*batch.args()), **TOL)
    torch.testing.assert_close(tiled, contiguous_attention(batch), **TOL)
    # The decode's rows are the walk's own: bit for bit.
    assert torch.equal(tiled[40], walked[40])


@pytest.mark.parametrize("block_size", [5, 8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_cross_blocks_of_any_size(monkeypatch, block_size, dtype):
    # 300 tokens at the end of a 600-token context: the value sums run in
    # blocks of about kTileValueKeys (256) keys for every row group, the rows'
    # causal ends falling inside the second and the third block.
    batch = make_paged_batch([600, 70], [300, 33], num_heads=14, num_kv_heads=2, head_dim=64,
                             block_size=block_size, dtype=dtype)
    tiled, walked = _both(batch, monkeypatch)
    if dtype == torch.float32:
        torch.testing.assert_close(tiled, walked, **TOL)
        torch.testing.assert_close(tiled, R.paged_attention(*batch.args()), **TOL)
    else:  # fp32 sums in another order, then one bf16 rounding: most outputs the walk's bits
        torch.testing.assert_close(tiled.float(), walked.float(), atol=2 ** -6, rtol=2 ** -6)
        assert (tiled == walked).float().mean().item() >= 0.95
        # The pair tiles' five key blocks (four of 125 at block size 5) round
        # each normalised probability as transformers does: 99.95 % of its bits.
        assert (tiled == eager_attention(batch)).float().mean().item() >= 0.99


@pytest.mark.parametrize("dtype, context", [(torch.float32, 10_000), (torch.bfloat16, 70_000)])
def test_long_context_shrinks_the_tile(monkeypatch, dtype, context):
    # fp32 at 10,000 keys goes to the online tile (ONLINE_MIN_KEYS: 40 x 7
    # rows); a bf16
    # pair tile keeps its context's scores, and past 65,536 keys its 18 tokens
    # x 7 heads would pass 16 MiB of them, so it holds fewer (pair_tile_tokens:
    # 17 here, the 40 queries in three tiles, the last ragged); the answer is
    # the walk's.
    batch = make_paged_batch([context], [40], num_heads=14, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=dtype)
    tiled, walked = _both(batch, monkeypatch)
    if dtype == torch.float32:
        torch.testing.assert_close(tiled, walked, **TOL)
    else:  # fp32 sums in another order: a few land on the other side of a bf16 rounding
        torch.testing.assert_close(tiled.float(), walked.float(), atol=2 ** -6, rtol=2 ** -6)
        assert (tiled == walked).float().mean().item() >= 0.95


def _online(batch, monkeypatch, min_keys, **kw):
    """The tiled output with ONLINE_MIN_KEYS = min_keys (0: the one-pass tiles
    only; 1: online tiles for every fp32 chunk, however few its rows)."""
    monkeypatch.setattr(cpu_attention, "TILE_MIN_QUERY", TILE_MIN_QUERY)
    monkeypatch.setattr(cpu_attention, "ONLINE_MIN_KEYS", min_keys)
    monkeypatch.setattr(cpu_attention, "ONLINE_MIN_ROWS", 0 if min_keys == 1 else ONLINE_MIN_ROWS)
    plan = cpu_attention.CpuAttentionPlan(in_place_seqs=torch.arange(batch.seq_lens.numel()))
    return cpu_attention.paged_attention(*batch.args(), plan=plan, **kw)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("head_dim", [32, 80, 128])
@pytest.mark.parametrize("block_size", [5, 16])
def test_online_tiles_match_the_walk_and_the_reference(monkeypatch, group, head_dim, block_size):
    """fp32 tiles in key blocks with an online softmax (attention_online.h),
    brought down to short contexts: 600 keys are three key blocks of 256 (of
    255 at block size 5, the last one partial), the rows' causal ends falling
    in the second and third; 300 queries are tiles of about equal size in
    whole row vectors: at group 4 three of 100 tokens (400 rows), at group 7
    four of 64 (448 rows) and one of 44 (308 rows and 4 of padding), at group
    1 one for each thread over the two kv heads (a single 300-token tile a
    head would leave the other threads idle); a cached prefix, a chunk whose
    every key is in the first block, and a decode that stays walked."""
    batch = make_paged_batch([600, 70, 9, 64], [300, 33, 9, 1], num_heads=2 * group, num_kv_heads=2,
                             head_dim=head_dim, block_size=block_size)
    online = _online(batch, monkeypatch, 1)
    one_pass = _online(batch, monkeypatch, 0)
    monkeypatch.setattr(cpu_attention, "TILE_MIN_QUERY", 0)
    walked = cpu_attention.paged_attention(*batch.args(),
                                           plan=cpu_attention.CpuAttentionPlan(in_place_seqs=torch.arange(4)))
    torch.testing.assert_close(online, walked, **TOL)
    torch.testing.assert_close(online, R.paged_attention(*batch.args()), **TOL)
    torch.testing.assert_close(online, contiguous_attention(batch), **TOL)
    assert not torch.equal(online[:300], one_pass[:300])  # the online tile did run (other sums, same answer)
    assert torch.equal(online[-1], walked[-1])  # the decode's row is the walk's own


def test_fp32_contexts_from_online_min_keys_go_online_and_bf16_never():
    # The product's thresholds: a chunk of 40 queries x 4 heads at 2,100 keys
    # goes online, one at 2,000 beside it keeps the one-pass tile, and so does
    # one of 15 x 4 = 60 rows at 2,100; bf16 tiles ignore the setting.
    assert (ONLINE_MIN_KEYS, ONLINE_MIN_ROWS) == (2048, 64)
    batch = make_paged_batch([2100, 2000, 2100], [40, 40, 15], num_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=16)
    mp = pytest.MonkeyPatch()
    try:
        default = _online(batch, mp, ONLINE_MIN_KEYS)
        always, never = _online(batch, mp, 1), _online(batch, mp, 0)
        assert torch.equal(default[:40], always[:40]) and not torch.equal(default[:40], never[:40])
        for rows in (slice(40, 80), slice(80, 95)):
            assert torch.equal(default[rows], never[rows]) and not torch.equal(default[rows], always[rows])
        torch.testing.assert_close(default, R.paged_attention(*batch.args()), **TOL)
        bf = make_paged_batch([300], [300], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                              dtype=torch.bfloat16)
        assert torch.equal(_online(bf, mp, 1), _online(bf, mp, 0))
    finally:
        mp.undo()


def test_online_tiles_read_nothing_past_each_length(monkeypatch):
    batch = make_paged_batch([450, 130], [450, 30], num_heads=14, num_kv_heads=2, head_dim=64, block_size=16)
    want = _online(batch, monkeypatch, 1)
    poison_unread(batch)
    got = _online(batch, monkeypatch, 1)
    assert torch.equal(got, want)


def test_tiles_read_nothing_past_each_length_and_leave_other_rows():
    batch = make_paged_batch([45, 30], [45, 30], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    want = R.paged_attention(*batch.args())
    poison_unread(batch)
    out = torch.full_like(batch.q, 7.0)
    plan = cpu_attention.CpuAttentionPlan(in_place_seqs=torch.tensor([1]))  # only the second sequence
    cpu_attention.paged_attention(*batch.args(), out=out, plan=plan)
    assert torch.all(out[:45] == 7.0)
    torch.testing.assert_close(out[45:], want[45:], **TOL)


def test_fp16_and_windowed_chunks_keep_the_walk(monkeypatch):
    # Tiles are fp32 or bf16 without a window or soft-capping; the rest walk
    # (and so give the walk's bits whatever TILE_MIN_QUERY says).
    half = make_paged_batch([40], [40], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                            dtype=torch.float16)
    tiled, walked = _both(half, monkeypatch)
    assert torch.equal(tiled, walked)
    # 256 tokens: enough scores that an fp32 summation order differing in
    # the last bits lands some bf16 roundings on the other side.
    fp = make_paged_batch([256], [256], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    bf = make_paged_batch([256], [256], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                          dtype=torch.bfloat16)
    for batch in (fp, bf):
        for kw in (dict(window=8), dict(softcap=30.0)):
            tiled, walked = _both(batch, monkeypatch, **kw)
            assert torch.equal(tiled, walked)
        tiled, walked = _both(batch, monkeypatch)
        assert not torch.equal(tiled, walked)  # the tiles did run here (summation order differs)


@pytest.mark.parametrize("group", [1, 7])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_bf16_tiles_round_where_transformers_rounds(monkeypatch, group, head_dim):
    """bf16 tiles round q.k, the scaled score, the probabilities and the
    output where transformers' eager attention does, as the walk does: the
    same elements as eager bf16 (but for sums whose order differs landing on
    the other side of a rounding), and far more of them than an fp32
    computation rounded once at the end."""
    batch = make_paged_batch([37, 50, 9, 150], [37, 3, 1, 40], num_heads=2 * group, num_kv_heads=2,
                             head_dim=head_dim, block_size=16, dtype=torch.bfloat16)
    tiled, walked = _both(batch, monkeypatch)
    eager = eager_attention(batch)
    for got in (tiled, walked):
        same = (got == eager).float().mean().item()
        assert same >= 0.99, f"{same:.3f} of the elements as transformers' eager bf16 attention"
        torch.testing.assert_close(got.float(), eager.float(), atol=2 ** -6, rtol=2 ** -6)
    assert (tiled == walked).float().mean().item() >= 0.99
    assert (R.paged_attention(*batch.args()) == eager).float().mean().item() < 0.9
    assert torch.equal(tiled[40], walked[40])  # the decode row is walked


def test_bf16_tiles_read_nothing_past_each_length(monkeypatch):
    batch = make_paged_batch([45, 130], [45, 30], num_heads=14, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=torch.bfloat16)
    want, _ = _both(batch, monkeypatch)
    poison_unread(batch)
    got, _ = _both(batch, monkeypatch)
    assert torch.equal(got, want)


@pytest.mark.parametrize("head_dim", [32, 80, 128])
@pytest.mark.parametrize("group", [1, 7])
@pytest.mark.parametrize("block_size", [5, 16])
def test_bf16_tiles_in_pairs_of_keys_and_dims(monkeypatch, head_dim, group, block_size):
    """Where the CPU has AVX512-BF16, bf16 tiles run on its pair dot product:
    odd contexts and odd blocks (a pair of keys across two blocks, a zero key
    past the end), 40 pairs of dims (head_dim 80), a cached prefix, every
    thread count. The walk's values and transformers' eager bf16 bits but for
    rare ties."""
    batch = make_paged_batch([203, 77, 2], [203, 31, 2], num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                             block_size=block_size, dtype=torch.bfloat16)
    eager = eager_attention(batch)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            tiled, walked = _both(batch, monkeypatch)
            torch.testing.assert_close(tiled.float(), walked.float(), atol=2 ** -6, rtol=2 ** -6)
            for got in (tiled, walked):
                same = (got == eager).float().mean().item()
                assert same >= 0.99, f"{same:.3f} of the elements as transformers' eager bf16 attention"
    finally:
        torch.set_num_threads(before)


def _amx_or_skip():
    if not cpu_build.has_amx():
        pytest.skip("no AMX on this CPU: bf16 tiles run on the pair kernel")
    if not cpu_attention.amx_tiles(torch.bfloat16, 64):
        pytest.fail("an AMX CPU whose build or kernel does not give the tiles AMX (kvpager_cpu.amx_usable)")


def test_an_amx_cpu_runs_bf16_tiles_of_head_dims_in_32s_on_amx(monkeypatch):
    _amx_or_skip()
    assert torch.ops.kvpager_cpu.amx_usable()
    assert [d for d in (32, 64, 80, 96, 128, 256) if cpu_attention.amx_tiles(torch.bfloat16, d)] == [32, 64, 96, 128, 256]
    assert not cpu_attention.amx_tiles(torch.float32, 64) and not cpu_attention.amx_tiles(torch.float16, 64)
    monkeypatch.setattr(cpu_attention, "AMX_TILES", False)
    assert not cpu_attention.amx_tiles(torch.bfloat16, 64)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 7])
@pytest.mark.parametrize("block_size", [5, 16, 32])
def test_amx_tiles_agree_with_the_pair_kernel_and_transformers(monkeypatch, head_dim, group, block_size):
    """AMX's products have the pair kernel's arithmetic (bf16 products, fp32
    sums) in another summation order: the same bits but for rare ties, across
    odd contexts (a partial chunk of 16 keys, keys gathered across blocks of
    5), a cached prefix, two-token chunks and every thread count."""
    _amx_or_skip()
    batch = make_paged_batch([203, 77, 2, 300], [203, 31, 2, 45], num_heads=2 * group, num_kv_heads=2,
                             head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16)
    plan = cpu_attention.CpuAttentionPlan(in_place_seqs=torch.arange(4))
    eager = eager_attention(batch)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = {}
            for amx in (True, False):
                monkeypatch.setattr(cpu_attention, "AMX_TILES", amx)
                got[amx] = cpu_attention.paged_attention(*batch.args(), plan=plan)
            torch.testing.assert_close(got[True].float(), got[False].float(), atol=2 ** -6, rtol=2 ** -6)
            assert (got[True] == got[False]).float().mean().item() >= 0.99
            same = (got[True] == eager).float().mean().item()
            assert same >= 0.99, f"{same:.3f} of the elements as transformers' eager bf16 attention"
    finally:
        torch.set_num_threads(before)


def test_amx_tiles_leave_onednn_matmuls_on_the_same_threads_intact():
    """The tiles configure AMX per call and release it after; oneDNN's bf16
    matmuls, on AMX on the same threads, give the same bits before and after."""
    _amx_or_skip()
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(256, 896, generator=gen).to(torch.bfloat16)
    w = torch.randn(896, 640, generator=gen).to(torch.bfloat16)
    want = a @ w
    torch.testing.assert_close(want.float(), a.float() @ w.float(), atol=0.25, rtol=2 ** -7)
    batch = make_paged_batch([150, 90], [150, 90], num_heads=14, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=torch.bfloat16)
    first = cpu_attention.paged_attention(*batch.args())
    assert torch.equal(a @ w, want)
    assert torch.equal(cpu_attention.paged_attention(*batch.args()), first)
    assert torch.equal(a @ w, want)


def test_fp32_tile_exp_is_exp2_within_an_ulp():
    # The fp32 online tiles score in base 2 and exponentiate with vec.h's
    # vexp2_16_nonpos: within an ulp of 2^x where the result is a normal
    # float, 0 for -inf (a masked key) and below -150, NaN kept. 100,003
    # inputs: a ragged last vector.
    x = torch.linspace(-126.0, 0.0, 100_003, dtype=torch.float64).float()
    got = torch.ops.kvpager_cpu.exp2_nonpos(x).double()
    want = torch.exp2(x.double())
    ulp = (torch.nextafter(want.float(), torch.tensor(float("inf"))).double() - want.float().double())
    assert ((got - want).abs() / ulp).max() <= 1.0
    whole = torch.tensor([0.0, -1.0, -10.0, -126.0])  # f = 0: the polynomial's constant term, exactly 1
    assert torch.equal(torch.ops.kvpager_cpu.exp2_nonpos(whole), torch.exp2(whole))
    special = torch.ops.kvpager_cpu.exp2_nonpos(torch.tensor([float("-inf"), -150.0, -1e30, float("nan")]))
    assert special[:3].tolist() == [0.0, 0.0, 0.0] and special[3].isnan()
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvpager_cpu.exp2_nonpos(x.double())
