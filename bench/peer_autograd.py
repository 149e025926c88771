"""bench/run.sh autograd -- the PyTorch peer: the workload of bench/autograd_bench.cc on torch.distributed.rpc,
dist_autograd and DistributedOptimizer (SGD), with the same local comparison (interleaved iterations).

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


def run_pair(d, batch, iters, with_local):
    """Distributed iterations, each followed (with_local) by a local one of the same model: interleaved, as ours."""
    w, b = make_layer(d)
    rpc.rpc_sync("w1", remote_make_layer, args=(d,))
    params = [rpc.RRef(w), rpc.RRef(b)] + rpc.rpc_sync("w1", remote_params)
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    la, lb = make_layer(d), make_layer(d)
    local_opt = torch.optim.SGD(la + lb, lr=0.01)
    x = torch.randn(batch, d)
    dist, local = [], []
    for i in range(iters + iters // 10):
        timed = i >= iters // 10
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            h = torch.nn.functional.linear(x, w, b)
            loss = rpc.rpc_sync("w1", forward_loss, args=(h,))
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        if timed:
            dist.append((time.perf_counter() - t0) * 1e6)
        if not with_local:
            continue
        t0 = time.perf_counter()
        local_opt.zero_grad()
        torch.nn.functional.linear(torch.nn.functional.linear(x, *la), *lb).pow(2).mean().backward()
        local_opt.step()
        if timed:
            local.append((time.perf_counter() - t0) * 1e6)
    return dist, local


def run(rank, port, args):
    impl = init(rank, 2, port, args.mode)
    if rank == 0:
        small, _ = run_pair(64, 8, args.small, False)
        emit_line("autograd", impl, "dist_autograd_small_iter_us", statistics.median(small), "us", processes=2, d=64,
                  batch=8, iters=args.small)
        dist, local = run_pair(1024, 64, args.large, True)
        dist_ms, local_ms = statistics.median(dist) / 1000, statistics.median(local) / 1000
        emit_line("autograd", impl, "dist_autograd_overhead_ms", dist_ms - local_ms, "ms", processes=2, d=1024,
                  batch=64, iters=args.large, dist_iter_ms=round(dist_ms, 3), local_iter_ms=round(local_ms, 3))
    rpc.shutdown()


if __name__ == "__main__":
    peer_main(__file__, run, 2, {"--small": 3000, "--large": 200})
