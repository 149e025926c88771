"""bench/run.sh autograd -- the PyTorch peer: the workload of bench/autograd_bench.cc on torch.distributed.rpc,
dist_autograd and DistributedOptimizer (SGD), with the same local comparison.

  python3 bench/peer_autograd.py default|tcp [--small N --large N]
"""
import math
import statistics
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer

from peer_common import emit as emit_line, init, main as peer_main

_remote = {}


def make_layer(d):
    return [(torch.randn(d, d) / math.sqrt(d)).requires_grad_(), torch.zeros(d).requires_grad_()]


def remote_make_layer(d):
    _remote["layer"] = make_layer(d)


def remote_params():
    return [rpc.RRef(p) for p in _remote["layer"]]


def forward_loss(h):
    w, b = _remote["layer"]
    return torch.nn.functional.linear(h, w, b).pow(2).mean()


def run_distributed(d, batch, iters):
    w, b = make_layer(d)
    rpc.rpc_sync("w1", remote_make_layer, args=(d,))
    params = [rpc.RRef(w), rpc.RRef(b)] + rpc.rpc_sync("w1", remote_params)
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    x = torch.randn(batch, d)
    t = []
    for i in range(iters + iters // 10):
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            h = torch.nn.functional.linear(x, w, b)
            loss = rpc.rpc_sync("w1", forward_loss, args=(h,))
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        if i >= iters // 10:
            t.append((time.perf_counter() - t0) * 1e6)
    return t


def run_local(d, batch, iters):
    a, b = make_layer(d), make_layer(d)
    opt = torch.optim.SGD(a + b, lr=0.01)
    x = torch.randn(batch, d)
    t = []
    for i in range(iters + iters // 10):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.linear(torch.nn.functional.linear(x, *a), *b).pow(2).mean().backward()
        opt.step()
        if i >= iters // 10:
            t.append((time.perf_counter() - t0) * 1e6)
    return t


def run(rank, port, args):
    impl = init(rank, 2, port, args.mode)
    if rank == 0:
        small = run_distributed(64, 8, args.small)
        emit_line("autograd", impl, "dist_autograd_small_iter_us", statistics.median(small), "us", processes=2, d=64,
                  batch=8, iters=args.small)
        dist_ms = statistics.median(run_distributed(1024, 64, args.large)) / 1000
        local_ms = statistics.median(run_local(1024, 64, args.large)) / 1000
        emit_line("autograd", impl, "dist_autograd_overhead_ms", dist_ms - local_ms, "ms", processes=2, d=1024,
                  batch=64, iters=args.large, dist_iter_ms=round(dist_ms, 3), local_iter_ms=round(local_ms, 3))
    rpc.shutdown()


if __name__ == "__main__":
    peer_main(__file__, run, 2, {"--small": 3000, "--large": 200})
