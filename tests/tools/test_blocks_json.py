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


def test_blocks_json_and_table_show_each_kv_group_and_the_window_saving():
    from rich.console import Console

    from kvpager_tools.blocks import render_table

    m = MemoryManager()
    m.register_executor(ExecutorSpec("e0", 64, 4, max_model_len=256, kv_group_windows=(0, 8)))
    m.step(StepInput(step_id=1, new_seqs=[NewSeq(1, "e0", list(range(1, 34)))], schedule_seq_ids=[1],
                     schedule_num_tokens=[33]))
    m.step(StepInput(step_id=2, appended_seq_ids=[1], appended_offsets=[0, 1], appended_tokens=[5],
                     schedule_seq_ids=[1], schedule_num_tokens=[1]))  # the decode frees what the window passed
    total, parts = m.accounting()
    data = snapshot_dict(memory_pb2.AccountingSnapshot(total=accounting_to_proto(total),
                                                       executors=[accounting_to_proto(p) for p in parts]))
    (ex,) = data["executors"]
    full, sliding = ex["kv_groups"]
    assert full == {"window": 0, "used_blocks": 9, "logical_blocks": 9, "full_attention_blocks": 9,
                    "window_saved_blocks": 0, "max_seq_blocks": 9}
    # 34 tokens computed, the next query at 34 reads keys 27..34: blocks 6..8 of 4 tokens.
    assert sliding == {"window": 8, "used_blocks": 3, "logical_blocks": 3, "full_attention_blocks": 9,
                       "window_saved_blocks": 6, "max_seq_blocks": 3}
    assert "kv_groups" not in data  # per executor only
    console = Console(record=True, width=200)
    console.print(render_table(data))
    text = console.export_text()
    assert "group 1 window_saved_blocks" in text and "3 (window 8)" in text
