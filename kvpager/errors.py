"""Domain errors. Raised by domain code (which never imports grpc) and mapped
to gRPC status codes in exactly one place: ``kvpager.server``'s interceptor.

Each class names its status by the gRPC code *name*, so this module stays free
of the grpc import.
"""

from __future__ import annotations


class KvpagerError(Exception):
    """Base of every error that reaches a client with a definite status."""

    status = "INTERNAL"

    def __init__(self, message: str, *, retry_after_s: float | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # A hint for RESOURCE_EXHAUSTED / UNAVAILABLE, sent as trailing metadata.
        self.retry_after_s = retry_after_s
        # The request field at fault (INVALID_ARGUMENT), for APIs that report it (OpenAI's "param").
        self.param = param


class InvalidArgument(KvpagerError):
    status = "INVALID_ARGUMENT"


class NotFound(KvpagerError):
    status = "NOT_FOUND"


class AlreadyExists(KvpagerError):
    status = "ALREADY_EXISTS"


class FailedPrecondition(KvpagerError):
    status = "FAILED_PRECONDITION"


class ResourceExhausted(KvpagerError):
    status = "RESOURCE_EXHAUSTED"


class Unavailable(KvpagerError):
    status = "UNAVAILABLE"


class Unauthenticated(KvpagerError):
    status = "UNAUTHENTICATED"


class PermissionDenied(KvpagerError):
    status = "PERMISSION_DENIED"


class Aborted(KvpagerError):
    status = "ABORTED"


class DeadlineExceeded(KvpagerError):
    status = "DEADLINE_EXCEEDED"


class Internal(KvpagerError):
    status = "INTERNAL"


class Unimplemented(KvpagerError):
    status = "UNIMPLEMENTED"


_BY_STATUS = {cls.status: cls for cls in KvpagerError.__subclasses__()}


def error_for_status(status: str, message: str) -> KvpagerError:
    """The domain error for a gRPC status name (a client re-raising a peer's status)."""
    cls = _BY_STATUS.get(status, KvpagerError)
    return cls(message)
