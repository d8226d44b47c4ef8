"""kvpager: LLM serving built around PagedAttention.

Shared plumbing for all services lives here: the gRPC server lifecycle
(`kvpager.server`), telemetry (`kvpager.telemetry`), domain errors and their
status codes (`kvpager.errors`), packed-array helpers (`kvpager.packed`),
the generated stubs (`kvpager.v1`) and the CLI (`kvpager.cli`).
"""

__version__ = "0.1.0"
