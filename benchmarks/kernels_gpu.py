"""GPU benchmark of the paged KV-cache kernels (H100/H200 class, CUDA only).

    python benchmarks/kernels_gpu.py --json > kernels_gpu.json

Measures
  * device copy bandwidth (a large D2D tensor copy: bytes read + written),
  * decode paged attention, bf16, 32 q heads / 4 kv heads (GQA 8), head_dim
    128, block 16 and 64, batch {1,16,64,256} x context {1K,4K,16K}:
    latency, achieved bandwidth (K/V bytes read / time), and torch SDPA on
    the same K/V stored contiguously, with the paged/contiguous latency ratio,
  * prefill (full prompts, and one chunk after a cached prefix) TFLOP/s,
    with torch SDPA (causal, contiguous) for reference on full prompts.
Timing is triton.testing.do_bench (median, L2 flushed between reps).
Designed to finish in a few minutes; the largest case needs ~18 GB.

The shape/byte/FLOP helpers are plain functions so tests can run them on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # run as a script from anywhere

DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 16384)
BLOCK_SIZES = (16, 64)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 4, 128
# (batch, prompt length, cached prefix length): prefix > 0 = chunked prefill
PREFILL_CASES = ((1, 4096, 0), (4, 2048, 0), (1, 16384, 0), (8, 1024, 0), (1, 2048, 6144))


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int
    block_size: int
    num_heads: int = NUM_HEADS
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM
    dtype_bytes: int = 2  # bf16

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.context // self.block_size)

    @property
    def num_blocks(self) -> int:
        # every sequence owns distinct blocks, plus a few spares so the
        # shuffled assignment is not the identity
        return self.batch * self.blocks_per_seq + 8

    @property
    def pool_shape(self) -> tuple:
        """One layer's [1, 2, NB, BS, KVH, D] pool."""
        return (1, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V a decode step must read (the bandwidth numerator)."""
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def memory_bytes(self) -> int:
        """Peak device memory: paged pool + contiguous K/V copy for SDPA."""
        pool = 2 * self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes
        return pool + self.kv_bytes


def decode_cases(batches: Sequence[int] = DECODE_BATCHES, contexts: Sequence[int] = DECODE_CONTEXTS,
                 block_sizes: Sequence[int] = BLOCK_SIZES) -> List[DecodeCase]:
    return [DecodeCase(b, c, bs) for bs in block_sizes for b in batches for c in contexts]


def causal_attention_flops(q_lens: Sequence[int], seq_lens: Sequence[int], num_heads: int, head_dim: int) -> int:
    """FLOPs of causal attention that skips masked work exactly: query j of a
    q-token chunk at the end of an L-token context sees L - q + j + 1 keys;
    each (query, key, head) costs 2*D for QK^T and 2*D for PV."""
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, seq_lens))
    return 4 * pairs * num_heads * head_dim


# --------------------------------------------------------------------------
# device side


def _bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9  # read + write


def _paged_decode_inputs(case: DecodeCase, gen: torch.Generator, dev: str):
    """Pool with shuffled blocks, block tables, decode queries, and the same
    K/V gathered into contiguous [B, KVH, L, D] tensors for SDPA."""
    pool = torch.empty(case.pool_shape, dtype=torch.bfloat16, device=dev).normal_(generator=gen)
    k_cache, v_cache = pool[0, 0], pool[0, 1]  # [NB, BS, KVH, D]
    perm = torch.randperm(case.num_blocks, device=dev, generator=gen)
    tables = perm[: case.batch * case.blocks_per_seq].view(case.batch, case.blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((case.batch,), case.context, dtype=torch.int32, device=dev)
    qsl = torch.arange(case.batch + 1, dtype=torch.int32, device=dev)
    q = torch.empty((case.batch, case.num_heads, case.head_dim), dtype=torch.bfloat16, device=dev).normal_(generator=gen)

    def contiguous(cache):  # [B, KVH, L, D]
        gathered = cache[tables.long()]  # [B, nb, BS, KVH, D]
        flat = gathered.view(case.batch, case.blocks_per_seq * case.block_size, case.num_kv_heads, case.head_dim)
        return flat[:, : case.context].transpose(1, 2).contiguous()

    return pool, q, k_cache, v_cache, tables, seq_lens, qsl, contiguous(k_cache), contiguous(v_cache)


def bench_decode(case: DecodeCase, gen: torch.Generator, dev: str = "cuda") -> Dict:
    """dev/gen other than CUDA only for CPU smoke tests of this script."""
    import kvpager_kernels as kernels

    pool, q, k_cache, v_cache, tables, seq_lens, qsl, k_c, v_c = _paged_decode_inputs(case, gen, dev)
    scale = case.head_dim ** -0.5
    out = torch.empty_like(q)
    group = case.num_heads // case.num_kv_heads

    def paged():
        kernels.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale, out=out)

    # GQA decode as plain SDPA: the `group` query heads of a kv head form a
    # length-`group` query block with no mask (all see the whole context).
    q_c = q.view(case.batch, case.num_kv_heads, group, case.head_dim)  # [B, KVH, G, D]

    def contiguous():
        return torch.nn.functional.scaled_dot_product_attention(q_c, k_c, v_c, scale=scale)

    paged()
    ref = contiguous().reshape(case.batch, case.num_heads, case.head_dim)
    max_abs_diff = float((out.float() - ref.float()).abs().max())
    paged_ms, sdpa_ms = _bench_ms(paged), _bench_ms(contiguous)
    result = dict(asdict(case), kv_bytes=case.kv_bytes, paged_ms=paged_ms, sdpa_contiguous_ms=sdpa_ms,
                  paged_gbps=case.kv_bytes / (paged_ms * 1e-3) / 1e9,
                  sdpa_contiguous_gbps=case.kv_bytes / (sdpa_ms * 1e-3) / 1e9,
                  paged_over_contiguous=paged_ms / sdpa_ms, max_abs_diff_vs_sdpa=max_abs_diff)
    del pool, k_c, v_c
    return result


def bench_prefill(batch: int, prompt: int, prefix: int, gen: torch.Generator, block_size: int = 16,
                  dev: str = "cuda", num_heads: int = NUM_HEADS, head_dim: int = HEAD_DIM) -> Dict:
    import kvpager_kernels as kernels

    context = prefix + prompt
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 8
    pool = torch.empty((1, 2, num_blocks, block_size, NUM_KV_HEADS, head_dim), dtype=torch.bfloat16,
                       device=dev).normal_(generator=gen)
    perm = torch.randperm(num_blocks, device=dev, generator=gen)
    tables = perm[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, (batch + 1) * prompt, prompt, dtype=torch.int32, device=dev)
    q = torch.empty((batch * prompt, num_heads, head_dim), dtype=torch.bfloat16, device=dev).normal_(generator=gen)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    flops = causal_attention_flops([prompt] * batch, [context] * batch, num_heads, head_dim)

    ms = _bench_ms(lambda: kernels.paged_attention(q, pool[0, 0], pool[0, 1], tables, seq_lens, qsl, scale, out=out))
    result = dict(batch=batch, prompt=prompt, prefix=prefix, block_size=block_size, num_heads=num_heads,
                  num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, flops=flops, paged_ms=ms,
                  paged_tflops=flops / (ms * 1e-3) / 1e12)
    if prefix == 0:
        # SDPA baseline: causal flash attention on contiguous [B, H, L, D];
        # K/V repeated to all heads (compute-bound, the copy is outside timing).
        qc = q.view(batch, prompt, num_heads, head_dim).transpose(1, 2)
        k_all = pool[0, 0][tables.long()].view(batch, -1, NUM_KV_HEADS, head_dim)[:, :context]
        v_all = pool[0, 1][tables.long()].view(batch, -1, NUM_KV_HEADS, head_dim)[:, :context]
        group = num_heads // NUM_KV_HEADS
        kc = k_all.transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
        vc = v_all.transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)  # noqa: E731
        ref = sdpa().transpose(1, 2).reshape_as(out)
        sdpa_ms = _bench_ms(sdpa)
        result.update(sdpa_contiguous_ms=sdpa_ms, sdpa_tflops=flops / (sdpa_ms * 1e-3) / 1e12,
                      max_abs_diff_vs_sdpa=float((out.float() - ref.float()).abs().max()))
    return result


def _iter_with_progress(items, label: str) -> Iterator:
    # Progress goes to stderr so stdout stays pure JSON.
    for i, item in enumerate(items):
        print(f"[{label} {i + 1}/{len(items)}] {item}", file=sys.stderr, flush=True)
        yield item


def run(max_decode_cases: Optional[int] = None) -> Dict:
    import triton

    start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    report: Dict = dict(device=props.name, sm_count=props.multi_processor_count,
                        torch=torch.__version__, triton=triton.__version__, dtype="bfloat16")
    report["copy_bandwidth_gbps"] = copy_bandwidth_gbps()
    cases = decode_cases()[:max_decode_cases]
    report["decode"] = []
    for case in _iter_with_progress(cases, "decode"):
        report["decode"].append(bench_decode(case, gen))
        torch.cuda.empty_cache()
    report["prefill"] = []
    for batch, prompt, prefix in _iter_with_progress(PREFILL_CASES, "prefill"):
        report["prefill"].append(bench_prefill(batch, prompt, prefix, gen))
        torch.cuda.empty_cache()
    report["elapsed_s"] = time.perf_counter() - start
    return report


def _print_table(report: Dict) -> None:
    print(f"{report['device']}  copy bandwidth {report['copy_bandwidth_gbps']:.0f} GB/s")
    print("decode (bf16, 32q/4kv, d128)")
    print(f"{'bs':>4} {'batch':>5} {'ctx':>6} {'paged ms':>9} {'GB/s':>7} {'sdpa ms':>8} {'GB/s':>7} {'ratio':>6}")
    for r in report["decode"]:
        print(f"{r['block_size']:>4} {r['batch']:>5} {r['context']:>6} {r['paged_ms']:>9.3f} {r['paged_gbps']:>7.0f} "
              f"{r['sdpa_contiguous_ms']:>8.3f} {r['sdpa_contiguous_gbps']:>7.0f} {r['paged_over_contiguous']:>6.2f}")
    print("prefill")
    for r in report["prefill"]:
        sdpa = f"  sdpa {r['sdpa_tflops']:.1f} TFLOP/s" if "sdpa_tflops" in r else ""
        print(f"  batch {r['batch']} prompt {r['prompt']} prefix {r['prefix']}: "
              f"{r['paged_ms']:.3f} ms  {r['paged_tflops']:.1f} TFLOP/s{sdpa}")
    print(f"elapsed {report['elapsed_s']:.0f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark the paged KV-cache kernels on a CUDA GPU.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("--quick", action="store_true", help="only the first 4 decode cases (smoke run)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_gpu.py: no CUDA device available; this benchmark needs an NVIDIA GPU "
              "(the CPU test suite covers correctness).", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernels_gpu.py: unset TRITON_INTERPRET; the interpreter cannot be benchmarked.", file=sys.stderr)
        return 2
    report = run(max_decode_cases=4 if args.quick else None)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
