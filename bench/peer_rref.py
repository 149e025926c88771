"""bench/run.sh rref -- the PyTorch peer: the workloads of bench/rref_bench.cc on torch.distributed.rpc RRefs.

  python3 bench/peer_rref.py default|tcp [--small N --churn N]

remote() uses the builtin torch.add (PyTorch's fastest path); the churn waits until the owner's RRef context holds no
owner RRef (its own debug counter), as ours waits on the owner's count.
"""
import statistics
import time

import torch
import torch.distributed.rpc as rpc

from peer_common import emit as emit_line, init, main as peer_main


def touch(r):
    return r.owner().id


def owned():
    return int(rpc._rref_context_get_debug_info()["num_owner_rrefs"])


def emit(impl, metric, value, unit, **extra):
    emit_line("rref", impl, metric, value, unit, processes=3, **extra)


def run(rank, port, args):
    impl = init(rank, 3, port, args.mode)
    if rank == 0:
        x = torch.ones(1)
        for _ in range(300):
            rpc.remote("w1", torch.add, args=(x, 1)).to_here()
        t = []
        for _ in range(args.small):
            t0 = time.perf_counter()
            rpc.remote("w1", torch.add, args=(x, 1)).to_here()
            t.append((time.perf_counter() - t0) * 1e6)
        emit(impl, "remote_to_here_p50_us", statistics.median(t), "us", iters=args.small)

        t0 = time.perf_counter()
        window = []
        for _ in range(args.churn):
            if len(window) == 128:
                window.pop(0).wait()
            r = rpc.remote("w1", torch.add, args=(x, 1))
            window.append(rpc.rpc_async("w2", touch, args=(r,)))
            del r
        for f in window:
            f.wait()
        window = []
        while rpc.rpc_sync("w1", owned) != 0:
            time.sleep(0.0002)
        dt = time.perf_counter() - t0
        emit(impl, "rref_churn_per_s", args.churn / dt, "rrefs/s", rrefs=args.churn)
    rpc.shutdown()


if __name__ == "__main__":
    peer_main(__file__, run, 3, {"--small": 3000, "--churn": 20000})
