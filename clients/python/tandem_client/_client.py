"""A client of a running Tandem job: authenticated like a worker, outside the job's ranks."""

import concurrent.futures
import hashlib
import hmac
import os
import socket
import threading
import time
from collections import namedtuple

import grpc
from google.protobuf.message import DecodeError

from . import tandem_rpc_pb2 as pb
from ._codec import Encoder, Frame
from ._errors import (CODE_NAMES, AuthenticationError, DeadlineExceeded, EncodeError, RemoteError, TandemError,
                      Unavailable)
from ._version import WIRE_VERSION

CLIENT_RANK = -1  # rpc/registry.h kClientRank
_CALL = "/tandem.wire.Worker/Call"

Worker = namedtuple("Worker", "name rank address")
Worker.__doc__ = "A worker of the job: its name, rank and gRPC address (host:port)."

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),  # the job's workers enforce their own limit, and name it
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _read(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} '{path}': {e.strerror}") from None


def client_token(secret):
    """The token a client outside the job authenticates with: HMAC-SHA256(secret, "tandem-client-v1"), hex
    (rpc/detail/auth.h). Give a process this token instead of the job's secret, and it can call the job only as a
    client: the job token of its workers cannot be derived from it."""
    key = secret if isinstance(secret, bytes) else os.fsencode(secret)  # the bytes a C++ worker reads
    if not key:
        raise ValueError("the job secret is empty")
    return hmac.new(key, b"tandem-client-v1", hashlib.sha256).hexdigest()


def _token_from_env():
    """The client token from TANDEM_CLIENT_TOKEN, or derived from TANDEM_SECRET / TANDEM_SECRET_FILE as workers read
    them (the environment's bytes; the file's first line up to its newline)."""
    if os.environ.get("TANDEM_CLIENT_TOKEN"):
        return os.environ["TANDEM_CLIENT_TOKEN"]
    if os.environ.get("TANDEM_SECRET"):
        return client_token(os.environb[b"TANDEM_SECRET"])
    path = os.environ.get("TANDEM_SECRET_FILE")
    if path:
        first = _read(path, "TANDEM_SECRET_FILE").split(b"\n", 1)[0]
        if first:
            return client_token(first)
        raise ValueError(f"TANDEM_SECRET_FILE='{path}' holds no secret")
    raise ValueError("no credentials: pass secret= or token=, or set TANDEM_CLIENT_TOKEN, TANDEM_SECRET or "
                     "TANDEM_SECRET_FILE")


def _tls_from_env():
    names = ("TANDEM_TLS_CA", "TANDEM_TLS_CERT", "TANDEM_TLS_KEY")
    values = [os.environ.get(n) for n in names]
    if not any(values):
        return None
    if not all(values):
        missing = ", ".join(n for n, v in zip(names, values) if not v)
        raise ValueError(f"TLS from the environment needs TANDEM_TLS_CA, TANDEM_TLS_CERT and TANDEM_TLS_KEY; "
                         f"missing: {missing}")
    return {"ca": values[0], "cert": values[1], "key": values[2],
            "server_name": os.environ.get("TANDEM_TLS_SERVER_NAME")}


def _grpc_error(e, prefix, timeout, worker=None, function=None):
    """A TandemError for a failed gRPC call (the transport's or the job's refusal, not the function's)."""
    code = e.code()
    details = e.details() or code.name
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(code.name, f"{prefix}no reply within {round(timeout * 1000)} ms", worker, function)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(code.name, f"{prefix}unreachable or dead: {details}", worker, function)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION):
        return AuthenticationError(code.name, prefix + details, worker, function)
    return TandemError(code.name, prefix + details, worker, function)


class Future:
    """The result of call_async: result(timeout=None) returns the value or raises the call's TandemError."""

    def __init__(self):
        self._done = concurrent.futures.Future()

    def result(self, timeout=None):
        return self._done.result(timeout)

    def done(self):
        return self._done.done()

    def add_done_callback(self, fn):
        self._done.add_done_callback(lambda _: fn(self))


class Client:
    """Joins a running job as a client: lists its workers and calls the functions they registered.

    master: the job's master, "host:port" (MASTER_ADDR and MASTER_PORT when None: where rank 0 serves the job's store).
    secret: the job's secret; only the client token derived from it (client_token()) is used and sent, never the
        secret itself.
    token: the client token itself, instead of the secret (a process given only this token cannot act as a worker).
        Neither given: TANDEM_CLIENT_TOKEN, else TANDEM_SECRET or TANDEM_SECRET_FILE.
    name: how workers see this caller (CallContext::caller_name, their metrics and logs); 1 to 128 bytes.
    timeout: seconds, the default deadline of every call and query (RpcOptions::rpc_timeout's default).
    tls: None, or a dict with "ca", "cert" and "key" (PEM file paths) and optionally "server_name", for a job that
        runs with TLS (its workers require a client certificate signed by their CA); TANDEM_TLS_* when None.
    tensors: "numpy" (default) or "torch": what a tensor in a reply becomes.

    Thread-safe: calls may be made from any thread, several at once. Close it (or use `with`) to release its channels.
    """

    def __init__(self, master=None, secret=None, *, token=None, name=None, timeout=60.0, tls=None, tensors="numpy"):
        if master is None:
            addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not addr or not port:
                raise ValueError("no master: pass master='host:port', or set MASTER_ADDR and MASTER_PORT")
            master = f"{addr}:{port}"
        if tensors not in ("numpy", "torch"):
            raise ValueError(f"tensors='{tensors}': 'numpy' or 'torch'")
        if tensors == "torch":
            from . import _codec
            if _codec.torch is None:
                raise ValueError("tensors='torch' needs PyTorch, which is not installed")
        if secret is not None and token is not None:
            raise ValueError("pass secret= or token=, not both")
        if token is None:
            token = client_token(secret) if secret is not None else _token_from_env()
        if not token:
            raise ValueError("the client token is empty")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}: a positive number of seconds")
        self.master = master
        self.name = name or f"python-{socket.gethostname()}"[:128]  # one metrics series per host, not per process
        if not 1 <= len(self.name.encode("utf-8")) <= 128:
            raise ValueError(f"name={self.name!r}: a client's name has 1 to 128 bytes")
        self.timeout = float(timeout)
        self._as_torch = tensors == "torch"
        self._metadata = (("x-tandem-auth", token), ("x-tandem-wire-version", str(WIRE_VERSION)))
        tls = _tls_from_env() if tls is None else tls
        if tls:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(tls["ca"], "the TLS CA"), private_key=_read(tls["key"], "the TLS key"),
                certificate_chain=_read(tls["cert"], "the TLS certificate"))
            self._options = _CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", tls["server_name"])]
                                                if tls.get("server_name") else [])
        else:
            self._credentials = None
            self._options = _CHANNEL_OPTIONS
        self._lock = threading.Lock()
        self._channels = {}
        self._workers = None
        self._closed = False

    # ---- the job's workers

    def workers(self, refresh=False):
        """The job's workers, by rank, read from the job's store at the master (cached; refresh=True reads again).
        Raises AuthenticationError for a wrong secret, Unavailable when the master cannot be reached, within the
        client's timeout."""
        with self._lock:
            if self._workers is not None and not refresh:
                return list(self._workers)
        prefix = f"listing the workers of the job at master '{self.master}': "
        channel = self._channel(self.master)
        get = channel.unary_unary("/tandem.wire.Store/Get", request_serializer=pb.StoreKey.SerializeToString,
                                  response_deserializer=pb.StoreValue.FromString)
        check = channel.unary_unary("/tandem.wire.Store/Check",
                                    request_serializer=pb.StoreWaitRequest.SerializeToString,
                                    response_deserializer=pb.StoreCheckReply.FromString)
        deadline = time.monotonic() + self.timeout

        def left():
            return max(0.001, deadline - time.monotonic())

        try:
            present = check(pb.StoreWaitRequest(keys=["worker/0"]), timeout=left(), metadata=self._metadata)
            if not present.present[0]:
                raise Unavailable("UNAVAILABLE", prefix + "rank 0 has not joined yet")
            first = self._record(get(pb.StoreKey(key="worker/0"), timeout=left(), metadata=self._metadata).value,
                                 0, prefix)
            workers = [first]
            world = first[1]
            keys = [f"worker/{rank}" for rank in range(1, world)]
            if keys:  # a rank still starting is named now, not at the deadline of a wait for its record
                present = check(pb.StoreWaitRequest(keys=keys), timeout=left(), metadata=self._metadata).present
                missing = [k.split("/")[1] for k, p in zip(keys, present) if not p]
                if missing:
                    raise Unavailable("UNAVAILABLE", f"{prefix}rank(s) {', '.join(missing)} of {world} have not "
                                      "joined yet")
            for rank in range(1, world):
                record = self._record(get(pb.StoreKey(key=f"worker/{rank}"), timeout=left(),
                                          metadata=self._metadata).value, rank, prefix)
                workers.append(record)
        except grpc.RpcError as e:
            raise _grpc_error(e, prefix, self.timeout) from None
        result = [Worker(w.name.decode("utf-8", "replace"), w.rank, w.grpc_address.decode("utf-8", "replace"))
                  for w, _ in workers]
        with self._lock:
            self._workers = result
        return list(result)

    @staticmethod
    def _record(data, rank, prefix):
        rec = pb.RendezvousRecord()
        try:
            rec.ParseFromString(data)
        except DecodeError:
            raise TandemError("DATA_LOSS", f"{prefix}rank {rank}'s record does not parse") from None
        if rec.wire_version != WIRE_VERSION:
            raise AuthenticationError("FAILED_PRECONDITION", f"{prefix}rank {rank} speaks Tandem wire version "
                                      f"{rec.wire_version}, this client version {WIRE_VERSION}")
        if rec.HasField("failed"):
            raise TandemError("ABORTED", f"{prefix}rank {rank} failed to join: "
                              f"{rec.failed.message.decode('utf-8', 'replace')}")
        if rec.worker.rank != rank:
            raise TandemError("DATA_LOSS", f"{prefix}rank {rank} published a malformed record")
        return rec.worker, rec.worker.world_size

    def _find(self, worker):
        if isinstance(worker, Worker):
            return worker
        workers = self.workers()
        for w in workers:
            if (isinstance(worker, int) and not isinstance(worker, bool) and w.rank == worker) or w.name == worker:
                return w
        names = ", ".join(w.name for w in workers)
        raise TandemError("NOT_FOUND", f"no worker {worker!r} in the job (workers: {names})")

    # ---- calls

    def call(self, worker, function, *args, timeout=None):
        """Calls `function` registered on `worker` (its name, rank or Worker) with `args`, and returns its result.
        Raises EncodeError before anything is sent for an argument the wire cannot carry; RemoteError when the
        function failed there (not registered, arguments that do not convert, an exception); DeadlineExceeded after
        `timeout` seconds (the client's by default); Unavailable when the worker cannot be reached."""
        return self.call_async(worker, function, *args, timeout=timeout).result()

    def call_async(self, worker, function, *args, timeout=None):
        """As call(), without waiting: returns a Future. EncodeError and an unknown worker are raised here."""
        timeout = self.timeout if timeout is None else float(timeout)
        w = self._find(worker)
        prefix = f"rpc to worker '{w.name}' (rank {w.rank}) calling '{function}': "
        request = pb.Request(function=function.encode("utf-8"), caller_name=self.name.encode("utf-8"),
                             caller_rank=CLIENT_RANK)
        encoder = Encoder()
        try:
            encoder.encode(args, request.args)
        except EncodeError as e:
            raise EncodeError(prefix + "cannot send the arguments: " + e.message, w.name,
                              function) from None
        frame = encoder.frame(request)
        future = Future()
        stub = self._channel(w.address).unary_unary(_CALL)  # raw bytes both ways: the frame is ours
        call = stub.future(frame, timeout=timeout, metadata=self._metadata)

        def done(c):
            # Whatever happens here completes the future: a caller waiting on it must never hang.
            try:
                value = self._reply(c.result(), prefix, w, function)
            except grpc.RpcError as e:
                future._done.set_exception(_grpc_error(e, prefix, timeout, w.name, function))
            except TandemError as e:
                future._done.set_exception(e)
            except grpc.FutureCancelledError:
                future._done.set_exception(TandemError("CANCELLED", prefix + "the client was closed", w.name,
                                                       function))
            except Exception as e:  # a defect of this client: reported as the call's error, never swallowed
                future._done.set_exception(TandemError("INTERNAL", f"{prefix}reading the reply failed: {e!r}",
                                                       w.name, function))
            else:
                future._done.set_result(value)

        call.add_done_callback(done)
        return future

    def _reply(self, data, prefix, w, function):
        response = pb.Response()
        try:
            frame = Frame(data, response)
            if response.HasField("error"):
                code = CODE_NAMES.get(response.error.code, str(response.error.code))
                message = prefix + response.error.message.decode("utf-8", "replace")
                cls = AuthenticationError if code == "UNAUTHENTICATED" else RemoteError
                raise cls(code, message, w.name, function)
            values = frame.decode(response.result, self._as_torch)
        except (ValueError, DecodeError) as e:
            raise TandemError("INTERNAL", f"{prefix}bad reply: {e}", w.name, function) from None
        except EncodeError as e:
            raise EncodeError(prefix + "cannot receive the result: " + e.message, w.name,
                              function) from None
        if len(values) != 1:
            raise TandemError("INTERNAL", f"{prefix}bad reply: expected one result", w.name, function)
        return values[0]

    # ---- channels

    def _channel(self, address):
        with self._lock:
            if self._closed:
                raise TandemError("CANCELLED", "the client is closed")
            channel = self._channels.get(address)
            if channel is None:
                if self._credentials:
                    channel = grpc.secure_channel(address, self._credentials, options=self._options)
                else:
                    channel = grpc.insecure_channel(address, options=self._options)
                self._channels[address] = channel
            return channel

    def close(self):
        """Closes the client's channels; calls in flight fail with CANCELLED."""
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for c in channels:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(master=None, secret=None, **kwargs):
    """Client(master, secret, **kwargs)."""
    return Client(master, secret, **kwargs)
