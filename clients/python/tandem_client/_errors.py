"""The errors of the Tandem client: one base class, a subclass per condition a caller handles differently.

Every message names the worker, the function and the cause, as Tandem's C++ errors do:
    DEADLINE_EXCEEDED: rpc to worker 'agent' (rank 0) calling 'act': no reply within 500 ms
"""

# absl::StatusCode, as an error reply carries it (tandem.wire.Error.code).
CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
    6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION", 10: "ABORTED",
    11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}


class TandemError(Exception):
    """A call or a query of the job failed. `code` is the status code's name ("NOT_FOUND", ...), `message` the rest;
    `worker` and `function` name the call (None where there was none, e.g. listing the workers)."""

    def __init__(self, code, message, worker=None, function=None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.worker = worker
        self.function = function


class RemoteError(TandemError):
    """The worker answered with an error: no such function, arguments that do not convert, the function threw, a
    function internal to Tandem."""


class AuthenticationError(TandemError):
    """The job refused this client's secret (UNAUTHENTICATED), or the client speaks another wire version
    (FAILED_PRECONDITION)."""


class DeadlineExceeded(TandemError, TimeoutError):
    """No reply within the call's timeout."""


class Unavailable(TandemError, ConnectionError):
    """The worker or the job's master cannot be reached: not started, dead, or the network is down."""


class EncodeError(TandemError, TypeError):
    """A value the wire cannot carry (raised before anything is sent), or a reply this client cannot represent."""

    def __init__(self, message, worker=None, function=None):
        super().__init__("INVALID_ARGUMENT", message, worker, function)
