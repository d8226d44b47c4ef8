"""What grpc's C core prints on a service's stderr.

Our processes log JSON lines and nothing else on stderr (docs/deploy.md).
Since grpc logs through absl, an unset ``GRPC_VERBOSITY`` leaves absl's
default, which prints INFO lines as plain text among ours: "Got goaway [2]
... Error code: 2" whenever a peer stops with calls still open, routine in
a stack that restarts parts. The entry points therefore set ``ERROR`` (the
level grpc printed before absl) unless the operator chose one; an operator
who wants grpc's traces sets ``GRPC_VERBOSITY=DEBUG`` beside ``GRPC_TRACE``.

grpc reads the variable once, when it is imported, so this runs before any
module that imports grpc; child processes inherit it.
"""

from __future__ import annotations

import os

VERBOSITY_ENV = "GRPC_VERBOSITY"
DEFAULT_VERBOSITY = "ERROR"


def quiet_grpc_core() -> str:
    """Sets ``GRPC_VERBOSITY=ERROR`` unless it is set already; returns the verbosity in force."""
    return os.environ.setdefault(VERBOSITY_ENV, DEFAULT_VERBOSITY)
