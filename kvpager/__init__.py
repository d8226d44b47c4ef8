"""kvpager: LLM serving built around PagedAttention.

Shared plumbing for all services lives here: the gRPC server lifecycle
(`kvpager.server`), telemetry (`kvpager.telemetry`), domain errors and their
status codes (`kvpager.errors`), packed-array helpers (`kvpager.packed`),
and the generated stubs (`kvpager.v1`). It imports no service; the
`kvpager` command and the rest of the tooling live in `kvpager_tools`.
"""

__version__ = "0.1.0"
