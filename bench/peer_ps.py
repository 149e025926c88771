"""bench/run.sh ps -- the PyTorch peer: the design of PyTorch's parameter-server tutorial ("Implementing a Parameter
Server Using Distributed RPC Framework"): the server holds the MLP 784-512-512-10, trainers run forward through
rpc_sync on it, dist_autograd.backward, and a DistributedOptimizer (SGD) over the server's parameter RRefs; 2 trainers,
batch 64, random inputs.

With two concurrent trainers that design fails (one trainer's in-place update changes weights the other's backward
saved: "modified by an inplace operation"), so a lock on the server serialises whole steps; ps_steps_per_s is the sum
over trainers.

  python3 bench/peer_ps.py default|tcp [--steps N]
"""
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import DistributedOptimizer

from peer_common import emit as emit_line, init, main as peer_main

_server = {}
_lock = threading.Lock()
_done = threading.Semaphore(0)


def get_model():
    if "model" not in _server:
        torch.manual_seed(0)
        _server["model"] = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                         nn.Linear(512, 10))
    return _server["model"]


def forward(x):
    return get_model()(x)


def param_rrefs():
    return [rpc.RRef(p) for p in get_model().parameters()]


def acquire():
    _lock.acquire()


def release():
    _lock.release()


_rates = []


def finished(rate):
    _rates.append(rate)
    _done.release()


def run(rank, port, args):
    impl = init(rank, 3, port, args.mode)
    trainers = 2
    if rank == 0:
        get_model()
        for _ in range(trainers):
            _done.acquire(timeout=1800)
        emit_line("ps", impl, "ps_steps_per_s", sum(_rates), "steps/s", processes=3, trainers=trainers,
                  model="mlp784-512-512-10", batch=64, mode="locked steps", steps_per_trainer=args.steps)
    else:
        opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("w0", param_rrefs), lr=0.01)
        x = torch.randn(64, 784)
        y = torch.randint(0, 10, (64,))
        warmup = args.steps // 10
        for s in range(warmup + args.steps):
            if s == warmup:
                t0 = time.perf_counter()
            rpc.rpc_sync("w0", acquire)
            try:
                with dist_autograd.context() as cid:
                    loss = F.cross_entropy(rpc.rpc_sync("w0", forward, args=(x,)), y)
                    dist_autograd.backward(cid, [loss])
                    opt.step(cid)
            finally:
                rpc.rpc_sync("w0", release)
        rpc.rpc_sync("w0", finished, args=(args.steps / (time.perf_counter() - t0),))
    rpc.shutdown()


if __name__ == "__main__":
    peer_main(__file__, run, 3, {"--steps": 2000})
