"""The Redis mirror of the prefix index (off by default; `--redis-url` turns it on).

keys.py      key schema and namespaces
scripts.py   the two Lua scripts (apply a flush, score a prefix)
writer.py    MirrorWriter: KV events -> Redis, off the hot path
reader.py    PrefixReader / AsyncPrefixReader: one-round-trip scoring for routers
recovery.py  rebuild cached blocks of confirmed executors after a restart
"""
