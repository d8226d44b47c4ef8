"""A checkpoint's attention spec per layer, read from its transformers config.

What transformers' model code passes each attention call as
``sliding_window`` (Mistral: every layer; Qwen2, Gemma 2 / 3: by
``layer_types``), so paged attention and the block manager honour exactly
the mask ``generate`` applies. A layer kind we cannot honour is refused at
start (``UnsupportedAttention``), never silently served as full attention
or cut to one window.
"""

from __future__ import annotations

from kvpager.kv_spec import KvGroupSpec, group_layers

FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedAttention(ValueError):
    """The checkpoint's attention pattern is one paged attention cannot serve."""


def layer_windows(text_config) -> list[int | None]:
    """Sliding window per layer (None = full attention)."""
    num_layers = text_config.num_hidden_layers
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise UnsupportedAttention(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = sorted({t for t in layer_types if t not in (FULL, SLIDING)})
        if unknown:
            raise UnsupportedAttention(f"attention kinds {unknown} are not supported (only {FULL!r} and "
                                       f"{SLIDING!r})")
        if SLIDING in layer_types and window is None:
            raise UnsupportedAttention("layer_types has sliding_attention layers but the config has no "
                                       "sliding_window")
        windows = [window if t == SLIDING else None for t in layer_types]
    elif text_config.model_type == "mistral":
        # Mistral's attention passes config.sliding_window on every layer.
        windows = [window] * num_layers
    else:
        if window is not None and getattr(text_config, "use_sliding_window", True):
            raise UnsupportedAttention(f"{text_config.model_type}: sliding_window {window} without layer_types; "
                                       "which layers it applies to is unknown")
        windows = [None] * num_layers
    try:
        group_layers(windows)
    except ValueError as exc:
        raise UnsupportedAttention(str(exc)) from exc
    return windows


def kv_groups(text_config) -> list[KvGroupSpec]:
    return group_layers(layer_windows(text_config))
