"""`kvpager blocks --json`: every accounting figure an operator is promised,
both counterfactuals and both usage levels included, straight from the
manager through the proto."""

from __future__ import annotations

from kvpager.v1 import memory_pb2
from kvpager_tools.blocks import KEYS, snapshot_dict
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.records import NewSeq, StepInput
from memory_service.servicer import accounting_to_proto


def test_blocks_json_carries_both_counterfactuals_and_both_usage_levels():
    m = MemoryManager()
    m.register_executor(ExecutorSpec("e0", 8, 4, max_model_len=32))
    m.step(StepInput(new_seqs=[NewSeq(1, "e0", list(range(6)), max_total_tokens=10)], schedule_seq_ids=[1],
                     schedule_num_tokens=[6]))
    total, parts = m.accounting()
    data = snapshot_dict(memory_pb2.AccountingSnapshot(total=accounting_to_proto(total),
                                                       executors=[accounting_to_proto(p) for p in parts]))
    assert {"block_usage", "token_occupancy", "contiguous_equivalent_blocks", "contiguous_declared_blocks",
            "recompute_query_tokens", "recompute_hit_rate"} <= set(KEYS)
    (ex,) = data["executors"]
    for d in (data, ex):
        assert (d["contiguous_equivalent_blocks"], d["contiguous_declared_blocks"]) == (8, 3)
        assert d["block_usage"] == 2 / 8 and d["token_occupancy"] == 6 / 32 and d["kv_utilization"] == 6 / 8
