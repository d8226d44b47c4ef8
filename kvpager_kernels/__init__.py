"""Paged KV-cache kernels: Triton launchers plus pure-torch references.

Named ``kvpager_kernels``, not ``kernels``: transformers imports Hugging
Face's ``kernels`` distribution by that name, which a package of ours would
shadow (docs/kernels.md).

``kvpager_kernels.store_kv`` / ``paged_attention`` / ``copy_blocks`` /
``copy_blocks_all_layers`` are the Triton launchers; ``kvpager_kernels.reference``
holds pure-torch equivalents with identical signatures. Triton is imported
lazily (PEP 562 ``__getattr__``) so ``import kvpager_kernels.reference`` works on
machines without triton.
"""

from __future__ import annotations

import importlib

__all__ = ["store_kv", "paged_attention", "copy_blocks", "copy_blocks_all_layers"]

# public name -> submodule that defines it (the submodule imports triton).
# Submodules are named triton_<op> rather than <op>: importing a submodule
# binds it as an attribute of the package, which would shadow a launcher of
# the same name (kernels.store_kv would turn into a module).
_LAUNCHERS = {
    "store_kv": "kvpager_kernels.triton_store_kv",
    "paged_attention": "kvpager_kernels.triton_paged_attention",
    "copy_blocks": "kvpager_kernels.triton_copy_blocks",
    "copy_blocks_all_layers": "kvpager_kernels.triton_copy_blocks",
}


def __getattr__(name: str):
    module = _LAUNCHERS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpager_kernels' has no attribute {name!r}")
    fn = getattr(importlib.import_module(module), name)
    globals()[name] = fn  # later lookups skip __getattr__
    return fn
