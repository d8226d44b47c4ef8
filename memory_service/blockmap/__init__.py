"""The live block map: every executor's pool as a grid in the browser,
pushed from the memory service's own state (docs/blockmap.md)."""
