"""Domain errors. Raised by domain code (which never imports grpc) and mapped
to gRPC status codes in exactly one place: ``kvpager.server``'s interceptor.

Each class names its status by the gRPC code *name*, so this module stays free
of the grpc import.
"""

from __future__ import annotations


class KvpagerError(Exception):
    """Base of every error that reaches a client with a definite status."""

    status = "INTERNAL"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        # A hint for RESOURCE_EXHAUSTED / UNAVAILABLE, sent as trailing metadata.
        self.retry_after_s = retry_after_s


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


# google.rpc.Code numbers, for statuses carried as data (StepPlan.rejected).
STATUS_NUMBERS = {
    "OK": 0,
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}

_BY_STATUS = {cls.status: cls for cls in KvpagerError.__subclasses__()}


def error_for_status(status: str | int, message: str) -> KvpagerError:
    """The domain error for a status name or number (used to re-raise a Rejection)."""
    if isinstance(status, int):
        status = next((k for k, v in STATUS_NUMBERS.items() if v == status), "INTERNAL")
    cls = _BY_STATUS.get(status, KvpagerError)
    return cls(message)
