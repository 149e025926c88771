"""bench/run.sh rpc -- the PyTorch peer: the same workloads as bench/rpc_bench.cc on torch.distributed.rpc (TensorPipe).

  python3 bench/peer_rpc.py default|tcp [--small N --bulk N --async N --bulk-mib M]   (a count of 0 skips its figure)

"default" is PyTorch's default configuration (TensorPipe picks shared memory and cross-memory-attach between processes
of one host); "tcp" forces its TCP transport and basic channel. Small calls use the builtin torch.add (PyTorch's
fastest path); the bulk call's function returns the element count. One intra-op thread per process.
"""
import statistics
import time

import torch
import torch.distributed.rpc as rpc

from peer_common import emit as emit_line, init, main as peer_main


def numel(t):
    return t.numel()


def emit(impl, metric, value, unit, **extra):
    emit_line("rpc", impl, metric, value, unit, processes=2, **extra)


def run(rank, port, args):
    impl = init(rank, 2, port, args.mode)
    if rank == 0:
        one = torch.ones(1)
        for _ in range(500):
            rpc.rpc_sync("w1", torch.add, args=(one, one))
        if args.small > 0:
            rtt = []
            for _ in range(args.small):
                t0 = time.perf_counter()
                rpc.rpc_sync("w1", torch.add, args=(one, one))
                rtt.append((time.perf_counter() - t0) * 1e6)
            rtt.sort()
            emit(impl, "small_rtt_p50_us", statistics.median(rtt), "us", iters=args.small,
                 p99_us=rtt[int(0.99 * (len(rtt) - 1))])

        if args.bulk > 0:
            big = torch.rand(args.bulk_mib << 18)
            gbps = []
            for i in range(args.bulk + 2):
                t0 = time.perf_counter()
                n = rpc.rpc_sync("w1", numel, args=(big,))
                dt = time.perf_counter() - t0
                assert n == big.numel()
                if i >= 2:
                    gbps.append(big.numel() * 4 / dt / 1e9)
            emit(impl, f"bulk_{args.bulk_mib}MiB_GBps", statistics.median(gbps), "GB/s", iters=args.bulk)

        calls = getattr(args, "async")
        if calls > 0:
            window = []
            t0 = time.perf_counter()
            for i in range(calls):
                if len(window) == 128:
                    window.pop(0).wait()
                window.append(rpc.rpc_async("w1", torch.add, args=(one, one)))
            for f in window:
                f.wait()
            dt = time.perf_counter() - t0
            emit(impl, "async_128_calls_per_s", calls / dt, "calls/s", calls=calls)
    rpc.shutdown()


if __name__ == "__main__":
    peer_main(__file__, run, 2, {"--small": 5000, "--bulk": 20, "--async": 50000, "--bulk-mib": 64})
