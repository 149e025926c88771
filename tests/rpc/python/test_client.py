"""The Python client (clients/python) against a live Tandem job, started by tests/rpc/python_client_test.cc: rank 0
is the GoogleTest process ("worker0"), rank 1 its child ("worker1"); both serve tests/rpc/main.cc's functions.

Environment: TANDEM_CLIENT_MASTER (host:port), TANDEM_SECRET, PYTHONPATH with the built package; TANDEM_TEST_TLS_DIR
for the TLS case. Run as `python3 test_client.py -v <TestCase>...`.
"""

import hashlib
import hmac
import os
import socket
import threading
import time
import unittest

import grpc
import numpy as np

import tandem_client as tc
from tandem_client import tandem_rpc_pb2 as pb

try:
    import torch
except ImportError:
    torch = None

MASTER = os.environ.get("TANDEM_CLIENT_MASTER", "")
SECRET = os.environ.get("TANDEM_SECRET", "")
TLS_DIR = os.environ.get("TANDEM_TEST_TLS_DIR")

# c10::ScalarType codes of the dtypes numpy has.
NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.int64, 5: np.float16, 6: np.float32,
                7: np.float64, 9: np.complex64, 10: np.complex128, 11: np.bool_}
C10_NAMES = {0: "Byte", 1: "Char", 2: "Short", 3: "Int", 4: "Long", 5: "Half", 6: "Float", 7: "Double",
             8: "ComplexHalf", 9: "ComplexFloat", 10: "ComplexDouble", 11: "Bool", 15: "BFloat16"}


def fnv1a(data):
    h = 14695981039346656037
    for b in bytes(data):
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h - (1 << 64) if h >= 1 << 63 else h


def random_array(dtype, shape, rng):
    """Random bits of `dtype` (NaN payloads and all), 0/1 for bool: a round trip is checked bit for bit."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    n = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(rng.bytes(n), dtype=dtype).reshape(shape).copy()


def pattern_bytes(nbytes, is_bool):
    """What the C++ function "pattern" writes (tests/rpc/main.cc)."""
    if is_bool:
        return bytes(1 if i % 3 == 0 else 0 for i in range(nbytes))
    return bytes((i * 31 + 7) & 0xFF for i in range(nbytes))


def client(**kwargs):
    return tc.Client(MASTER, SECRET, name="pytest", timeout=kwargs.pop("timeout", 30.0), **kwargs)


class WithJob(unittest.TestCase):
    """Test cases sharing one client of the job."""

    @classmethod
    def setUpClass(cls):
        cls.job = client()

    @classmethod
    def tearDownClass(cls):
        cls.job.close()


class Workers(unittest.TestCase):
    def test_lists_the_job_by_rank(self):
        with client() as job:
            workers = job.workers()
            self.assertEqual([(w.name, w.rank) for w in workers], [("worker0", 0), ("worker1", 1)])
            for w in workers:
                self.assertRegex(w.address, r"^[0-9.]+:[0-9]+$")
            self.assertEqual(job.call("worker1", "whoami"), "worker1")
            self.assertEqual(job.call(0, "whoami"), "worker0")
            self.assertEqual(job.call(workers[1], "whoami"), "worker1")

    def test_the_worker_sees_a_client_outside_the_job(self):
        with tc.Client(MASTER, SECRET, name="observer-7") as job:
            self.assertEqual(job.call("worker1", "caller"), "observer-7")
            self.assertEqual(job.call("worker1", "caller_rank"), tc.CLIENT_RANK)

    def test_master_and_secret_from_the_environment(self):
        host, port = MASTER.rsplit(":", 1)
        saved = dict(os.environ)
        try:
            os.environ.update({"MASTER_ADDR": host, "MASTER_PORT": port, "TANDEM_SECRET": SECRET})
            with tc.Client() as job:
                self.assertEqual(len(job.workers()), 2)
        finally:
            os.environ.clear()
            os.environ.update(saved)


class Values(WithJob):
    def echo(self, v):
        return self.job.call("worker1", "echo", v)

    def test_scalars(self):
        for v in [None, True, False, 0, -1, 2**63 - 1, -(2**63), 1.5, -0.0, float("inf"), 1e-300, 3 + 4j,
                  "", "héllo ✓ 世界", "a\x00b"]:
            got = self.echo(v)
            self.assertEqual(type(got), type(v), v)
            self.assertEqual(got, v)
        nan = self.echo(float("nan"))
        self.assertTrue(nan != nan)
        self.assertEqual(self.echo(b"\xff\x00raw"), b"\xff\x00raw")  # bytes that are not UTF-8 come back as bytes
        self.assertEqual(self.echo(np.int32(7)), 7)
        self.assertEqual(self.echo(np.float32(0.5)), 0.5)
        self.assertIs(self.echo(np.bool_(True)), True)

    def test_containers(self):
        value = {"ints": [1, 2, 3], "nested": [[1.0], [2.0, 3.0]], "mixed": [1, "a", None], "tuple": (1, "x", 2.5),
                 "empty": [], "dict": {1: "one", 2: "two"}, "deep": {"a": {"b": {"c": [()]}}}}
        self.assertEqual(self.echo(value), value)

    def test_types_as_the_cpp_side_sees_them(self):
        cases = [([1, 2], "List[int]"), ([1.0, 2.0], "List[float]"), (["a"], "List[str]"), ([True], "List[bool]"),
                 ([1, "a"], "List[Any]"), ({"a": 1}, "Dict[str, int]"), ({1: "a"}, "Dict[int, str]"),
                 ((1, "a", 2.0), "Tuple[int, str, float]"), (7, "int"), (2.5, "float"), ("s", "str"),
                 (None, "NoneType"), ({"w": np.zeros(2, np.float32)}, "Dict[str, Tensor]"),
                 (np.zeros(3, np.int64), "Tensor[Long]"), ([np.zeros(1), np.ones(1)], "List[Tensor]")]
        for value, want in cases:
            self.assertEqual(self.job.call("worker1", "describe", value), want, value)

    def test_several_arguments_convert_to_the_cpp_signature(self):
        out = self.job.call("worker1", "add", np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32))
        np.testing.assert_array_equal(out, np.arange(1, 5, dtype=np.float32))


class Tensors(WithJob):
    def assert_bits(self, got, want):
        self.assertIsInstance(got, np.ndarray)
        self.assertEqual(got.dtype, want.dtype)
        self.assertEqual(got.shape, want.shape)
        self.assertEqual(got.tobytes(), np.ascontiguousarray(want).tobytes())

    def test_every_numpy_dtype_both_ways_bit_exact(self):
        rng = np.random.default_rng(0)
        for code, dtype in NUMPY_DTYPES.items():
            for shape in [(), (0,), (5,), (3, 4, 2)]:
                with self.subTest(dtype=np.dtype(dtype).name, shape=shape):
                    a = random_array(dtype, shape, rng)
                    self.assert_bits(self.job.call("worker1", "echo", a), a)
                    name, sizes, digest = self.job.call("worker1", "digest", a)
                    self.assertEqual((name, tuple(sizes)), (C10_NAMES[code], shape))
                    self.assertEqual(digest, fnv1a(a.tobytes()))
                    made = self.job.call("worker1", "pattern", code, list(shape))
                    self.assertEqual(made.dtype, np.dtype(dtype))
                    self.assertEqual(made.tobytes(), pattern_bytes(made.nbytes, dtype == np.bool_))

    def test_views_byte_order_and_sharing(self):
        base = np.arange(24, dtype=np.float64).reshape(4, 6)
        view = base[:, 1::2].T  # not contiguous: sent packed
        self.assert_bits(self.job.call("worker1", "echo", view), np.ascontiguousarray(view))
        big_endian = np.arange(5, dtype=">i4")
        got = self.job.call("worker1", "echo", big_endian)
        self.assertEqual(got.dtype, np.dtype("<i4"))
        np.testing.assert_array_equal(got, np.arange(5))
        # One array given twice goes once and comes back as one array, as between C++ workers.
        a = np.ones(3, np.float32)
        x, y = self.job.call("worker1", "echo", (a, a))
        self.assertIs(x, y)
        x[0] = 5  # replies are the caller's, writable
        self.assertEqual(y[0], 5)

    def test_large_tensor(self):
        a = random_array(np.float32, (1 << 21,), np.random.default_rng(1))  # 8 MiB
        self.assert_bits(self.job.call("worker1", "echo", a), a)

    @unittest.skipIf(torch is None, "PyTorch is not installed")
    def test_torch_tensors_both_ways_bit_exact(self):
        with client(tensors="torch") as job:
            for dtype in [torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16, torch.complex64,
                          torch.float16, torch.uint8]:
                with self.subTest(dtype=str(dtype)):
                    t = (torch.randn(3, 5) * 100).to(dtype)
                    got = job.call("worker1", "echo", t)
                    self.assertIsInstance(got, torch.Tensor)
                    self.assertEqual(got.dtype, dtype)
                    self.assertTrue(torch.equal(got, t))
            made = job.call("worker1", "pattern", 15, [4])  # bfloat16: no numpy dtype, fine as torch
            self.assertEqual(made.dtype, torch.bfloat16)
            self.assertEqual(made.view(torch.int16).numpy().tobytes(), pattern_bytes(8, False))
            # A tensor that requires grad, a non-contiguous one, a lazily conjugated one: each goes as its values.
            w = torch.ones(2, 3, requires_grad=True)
            self.assertTrue(torch.equal(job.call("worker1", "echo", w.t()), w.detach().t()))
            z = torch.complex(torch.arange(3.0), torch.ones(3)).conj()
            self.assertTrue(z.is_conj())
            self.assertTrue(torch.equal(job.call("worker1", "echo", z), z.resolve_conj()))

    def test_bfloat16_without_torch_is_a_clear_error(self):
        with self.assertRaises(tc.EncodeError) as e:
            self.job.call("worker1", "pattern", 15, [4])
        self.assertIn("bfloat16", str(e.exception))
        self.assertIn("tensors='torch'", str(e.exception))


class Concurrency(unittest.TestCase):
    def test_calls_in_flight_and_from_threads(self):
        with client() as job:
            futures = [job.call_async(i % 2, "echo", i) for i in range(64)]
            self.assertEqual([f.result(timeout=30) for f in futures], list(range(64)))
            errors = []

            def worker(k):
                try:
                    for i in range(20):
                        assert job.call("worker1", "echo", [k, i]) == [k, i]
                except Exception as e:  # reported below
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
                self.assertFalse(t.is_alive(), "a thread's calls did not finish within 60 s")
            self.assertEqual(errors, [])


class Errors(WithJob):
    def check(self, cls, code, words, f, *args, **kwargs):
        with self.assertRaises(cls) as e:
            f(*args, **kwargs)
        self.assertEqual(e.exception.code, code, str(e.exception))
        for w in words:
            self.assertIn(w, str(e.exception))
        return e.exception

    def test_unknown_function(self):
        e = self.check(tc.RemoteError, "NOT_FOUND", ["worker 'worker1' (rank 1)", "'no_such_fn'"], self.job.call,
                       "worker1", "no_such_fn", 1)
        self.assertEqual((e.worker, e.function), ("worker1", "no_such_fn"))

    def test_the_function_throws(self):
        self.check(tc.RemoteError, "UNKNOWN", ["worker 'worker1'", "'throw_error'", "boom from python"],
                   self.job.call, "worker1", "throw_error", "boom from python")

    def test_arguments_that_do_not_convert(self):
        self.check(tc.RemoteError, "INVALID_ARGUMENT", ["'add'", "argument 1"], self.job.call, "worker1", "add",
                   "not a tensor", np.ones(2))
        self.check(tc.RemoteError, "INVALID_ARGUMENT", ["'add'", "expects 2 arguments, got 1"], self.job.call,
                   "worker1", "add", np.ones(2))

    def test_internal_functions_are_refused(self):
        self.check(tc.RemoteError, "PERMISSION_DENIED", ["internal to Tandem", "__tandem.rref.delete"],
                   self.job.call, "worker1", "__tandem.rref.delete", [1, 2])

    def test_deadline(self):
        t0 = time.monotonic()
        self.check(tc.DeadlineExceeded, "DEADLINE_EXCEEDED", ["'sleep_ms'", "no reply within 300 ms"],
                   self.job.call, "worker1", "sleep_ms", 3000, timeout=0.3)
        self.assertLess(time.monotonic() - t0, 2.0)
        self.assertEqual(self.job.call("worker1", "whoami"), "worker1")  # the worker still serves

    def test_values_that_cannot_be_encoded_are_refused_before_sending(self):
        before = self.job.call("worker1", "bumps")
        self.job.call("worker1", "bump_any", 1)  # the counter counts what arrives
        self.assertEqual(self.job.call("worker1", "bumps"), before + 1)
        before += 1
        for bad, words in [({1, 2}, ["argument 1", "set"]), (object(), ["argument 1", "object"]),
                           ([1, [2, 2**64]], ["argument 1[1][1]", "64 bits"]),
                           (np.array([object()]), ["dtype object"]), ({(1, 2): 3}, ["dict key"]),
                           ("\ud800", ["Unicode"])]:
            with self.subTest(bad=repr(bad)):
                self.check(tc.EncodeError, "INVALID_ARGUMENT", ["cannot send the arguments", "'bump_any'"] + words,
                           self.job.call, "worker1", "bump_any", bad)
        self.assertEqual(self.job.call("worker1", "bumps"), before)  # nothing reached the worker

    def raw_call(self, request, token=None):
        """Sends `request` as it is (what this client never sends) to worker1, with this client's token or `token`;
        returns the reply's error."""
        w = self.job.workers()[1]
        metadata = self.job._metadata if token is None else (("x-tandem-auth", token),
                                                             ("x-tandem-wire-version", str(tc.WIRE_VERSION)))
        data = self.job._channel(w.address).unary_unary("/tandem.wire.Worker/Call")(
            tc._codec.Encoder().frame(request), timeout=10, metadata=metadata)
        response = pb.Response()
        tc._codec.Frame(data, response)
        return tc._errors.CODE_NAMES[response.error.code], response.error.message.decode()

    def test_what_only_ranks_may_send_or_receive_is_refused(self):
        # A remote reference (any extension value) is the job's own: a client neither receives nor sends one.
        self.check(tc.RemoteError, "FAILED_PRECONDITION", ["'make_device'", "'test.device'",
                                                           "cannot be sent to a client outside the job"],
                   self.job.call, "worker1", "make_device")
        request = pb.Request(function=b"echo", caller_name=b"raw", caller_rank=tc.CLIENT_RANK)
        value = request.args.values.add()
        value.ext.kind, value.ext.data = "test.device", b"cpu@1"
        code, message = self.raw_call(request)
        self.assertEqual(code, "INVALID_ARGUMENT")
        self.assertIn("cannot come from a client outside the job", message)
        # Nor does it take part in distributed autograd.
        request = pb.Request(function=b"echo", caller_name=b"raw", caller_rank=tc.CLIENT_RANK, trace=b"\x08\x01")
        request.args.values.add().i = 1
        code, message = self.raw_call(request)
        self.assertEqual((code, "distributed autograd" in message), ("FAILED_PRECONDITION", True), message)
        # A client names itself, within bounds.
        for name in [b"", b"x" * 129]:
            code, message = self.raw_call(pb.Request(function=b"whoami", caller_name=name, caller_rank=-1))
            self.assertEqual((code, "a client's name has 1 to 128 bytes" in message), ("INVALID_ARGUMENT", True))
        # A client's token calls as a client, whatever rank the request claims: it cannot pass for a worker.
        for rank in (0, 1, 7):
            code, message = self.raw_call(pb.Request(function=b"__tandem.rref.delete", caller_name=b"raw",
                                                     caller_rank=rank))
            self.assertEqual((code, f"calls as caller rank -1, not as rank {rank}" in message),
                             ("PERMISSION_DENIED", True), message)
        # With the job's own token, a rank that is not in the job is malformed, as always.
        job_token = hmac.new(SECRET.encode(), b"tandem-auth-v1", hashlib.sha256).hexdigest()
        code, message = self.raw_call(pb.Request(function=b"whoami", caller_name=b"raw", caller_rank=7), job_token)
        self.assertEqual((code, "caller rank 7 is not in the job" in message), ("INVALID_ARGUMENT", True), message)

    def test_a_client_reads_the_store_but_does_not_write_it(self):
        channel = self.job._channel(MASTER)
        set_ = channel.unary_unary("/tandem.wire.Store/Set", request_serializer=pb.StoreSetRequest.SerializeToString,
                                   response_deserializer=pb.StoreEmpty.FromString)
        with self.assertRaises(grpc.RpcError) as e:
            set_(pb.StoreSetRequest(key="worker/1", value=b"forged"), timeout=10, metadata=self.job._metadata)
        self.assertEqual(e.exception.code(), grpc.StatusCode.PERMISSION_DENIED)
        self.assertIn("does not write it", e.exception.details())
        self.assertEqual(self.job.workers(refresh=True)[1].name, "worker1")

    def test_the_client_token_alone_is_enough(self):
        with tc.Client(MASTER, token=tc.client_token(SECRET), name="token-only") as job:
            self.assertEqual(job.call("worker1", "caller"), "token-only")
        with self.assertRaises(ValueError):
            tc.Client(MASTER, SECRET, token="x")

    def test_unknown_worker(self):
        self.check(tc.TandemError, "NOT_FOUND", ["no worker 'worker9'", "worker0, worker1"], self.job.call,
                   "worker9", "whoami")

    def test_wrong_secret(self):
        with tc.Client(MASTER, "not-the-secret", timeout=10) as bad:
            self.check(tc.AuthenticationError, "UNAUTHENTICATED", ["listing the workers", "secret"], bad.workers)
            self.check(tc.AuthenticationError, "UNAUTHENTICATED", ["worker 'worker1'", "secret"], bad.call,
                       self.job.workers()[1], "whoami")

    def test_bad_options(self):
        with self.assertRaises(ValueError):
            tc.Client(MASTER, "")
        with self.assertRaises(ValueError):
            tc.Client(MASTER, SECRET, tensors="jax")
        with self.assertRaises(ValueError):
            tc.Client(MASTER, SECRET, timeout=0)
        with self.assertRaises(ValueError):
            tc.Client(MASTER, SECRET, name="n" * 129)


class Dead(unittest.TestCase):
    """Rank 1 was killed (SIGKILL) before these run; rank 0 still serves."""

    def test_dead_worker_fails_fast(self):
        with client(timeout=20) as job:
            self.assertEqual(len(job.workers()), 2)  # still listed: its record stays in the store
            t0 = time.monotonic()
            self.check_unavailable(job.call, "worker1", "whoami")
            self.assertLess(time.monotonic() - t0, 10)
            self.assertEqual(job.call("worker0", "whoami"), "worker0")

    def test_no_job_at_the_address(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there now
        with tc.Client(f"127.0.0.1:{port}", SECRET, timeout=5) as job:
            t0 = time.monotonic()
            self.check_unavailable(job.workers)
            self.assertLess(time.monotonic() - t0, 5.5)

    def test_a_job_that_never_answers_fails_at_the_deadline(self):
        s = socket.socket()  # accepts connections in the kernel, never speaks: a hung master
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        try:
            with tc.Client(f"127.0.0.1:{s.getsockname()[1]}", SECRET, timeout=1.0) as job:
                t0 = time.monotonic()
                with self.assertRaises((tc.DeadlineExceeded, tc.Unavailable)) as e:
                    job.workers()
                self.assertIn("listing the workers", str(e.exception))
                elapsed = time.monotonic() - t0
                self.assertGreater(elapsed, 0.9)
                self.assertLess(elapsed, 3.0)
        finally:
            s.close()

    def check_unavailable(self, f, *args):
        with self.assertRaises(tc.Unavailable) as e:
            f(*args)
        self.assertEqual(e.exception.code, "UNAVAILABLE")
        self.assertIn("unreachable or dead", str(e.exception))


@unittest.skipUnless(TLS_DIR, "TANDEM_TEST_TLS_DIR is not set")
class Tls(unittest.TestCase):
    def tls(self):
        return {"ca": f"{TLS_DIR}/ca.crt", "cert": f"{TLS_DIR}/node.crt", "key": f"{TLS_DIR}/node.key"}

    def test_calls_with_the_job_certificates(self):
        with client(tls=self.tls()) as job:
            self.assertEqual([w.name for w in job.workers()], ["worker0", "worker1"])
            a = np.arange(10, dtype=np.float32)
            np.testing.assert_array_equal(job.call("worker1", "echo", a), a)

    def test_plain_text_is_refused(self):
        with client(timeout=5) as job:
            with self.assertRaises(tc.Unavailable):
                job.workers()


class StopsItsWorker(unittest.TestCase):
    """Run alone by MultiprocPythonClient.AFunctionRunningWhenItsWorkerShutsDownIsAnswered: worker0 shuts down while
    its "stop_soon" runs."""

    def test_the_call_that_stops_the_worker_is_answered(self):
        job = client()
        try:
            self.assertEqual(job.call("worker0", "stop_soon"), 1)
        finally:
            job.close()


if __name__ == "__main__":
    unittest.main()
