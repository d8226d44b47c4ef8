"""How the pool's memory maps to layers: one slot per layer, or shared slots
per KV group (the hybrid layout).

``per-layer`` (the default): the pool is [num_layers, 2, NB, BS, KVH, D], a
block holds every layer's K/V of its tokens, and one block table serves all
layers (sliding layers just never read the blocks their window passed).

``hybrid``: layers are split into table groups of one attention spec and S
layers each (S = the smallest spec's layer count; a larger spec makes
several groups, the last one padded). The pool is [S, 2, NB, BS, KVH, D]:
a block belongs to one group and holds the K/V of that group's S layers,
layer j of the group in slot j — vLLM's hybrid layout, so a sliding group's
freed block is memory another group can use. Plans then carry one table per
group (``ExecutorPlan.group_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpager.kv_spec import KvGroupSpec, group_layers

LAYOUTS = ("per-layer", "hybrid")


@dataclass(frozen=True, slots=True)
class KvLayout:
    name: str
    groups: tuple[KvGroupSpec, ...]   # the tables a plan carries, in order (group 0 = ExecutorPlan.tables)
    layer_group: tuple[int, ...]      # per layer: its table group
    layer_slot: tuple[int, ...]       # per layer: its pool slot
    layer_window: tuple[int | None, ...]
    num_slots: int


def make_layout(name: str, windows: list[int | None]) -> KvLayout:
    if name not in LAYOUTS:
        raise ValueError(f"kv_layout must be one of {LAYOUTS}, got {name!r}")
    num_layers = len(windows)
    if name == "per-layer":
        # One table for every layer: a table group with no window (it keeps every block).
        return KvLayout(name, (KvGroupSpec(None, tuple(range(num_layers))),), (0,) * num_layers,
                        tuple(range(num_layers)), tuple(windows), num_layers)
    specs = group_layers(windows)
    size = min(len(s.layers) for s in specs)
    groups: list[KvGroupSpec] = []
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for spec in specs:
        for start in range(0, len(spec.layers), size):
            chunk = spec.layers[start:start + size]
            for slot, layer in enumerate(chunk):
                layer_group[layer], layer_slot[layer] = len(groups), slot
            groups.append(KvGroupSpec(spec.window, chunk))
    return KvLayout(name, tuple(groups), tuple(layer_group), tuple(layer_slot), tuple(windows), size)
