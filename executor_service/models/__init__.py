"""The executor's model implementations.

``llama`` is our own compact forward for the Llama family (fused q/k/v and
gate/up projections, packed matmuls, K/V written and attended in the pool's
[T, heads, dim] layout with no transposes); ``hf`` runs the transformers
model code with our paged attention registered into it, for every other
checkpoint transformers loads. ``ModelRunner`` picks one (``--model-impl``).
"""

from __future__ import annotations

from collections.abc import Callable


class ForwardStopped(Exception):
    """A forward ended between layers because its ``ForwardBatch.stop`` said
    so: no logits. The layers before wrote K/V only into the slots the batch
    was given, which the caller then counts as not computed."""


def check_stop(stop: Callable[[], bool] | None, layer: int) -> None:
    """Before ``layer``: raise ForwardStopped when ``stop`` says so."""
    if stop is not None and stop():
        raise ForwardStopped(f"stopped before layer {layer}")
