"""The executor's model implementations.

``llama`` is our own compact forward for the Llama family (fused q/k/v and
gate/up projections, packed matmuls, K/V written and attended in the pool's
[T, heads, dim] layout with no transposes); ``hf`` runs the transformers
model code with our paged attention registered into it, for every other
checkpoint transformers loads. ``ModelRunner`` picks one (``--model-impl``).
"""
