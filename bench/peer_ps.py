"""bench/run.sh ps -- the PyTorch peer, in PyTorch's best configuration for what Tandem's side runs (--design sync, the
default): the server holds the MLP 784-512-512-10; 2 trainers, batch 64, random inputs; each step a trainer runs the
forward through rpc_sync on the server, dist_autograd.backward, then rpc_sync of an async_execution `submit` on the
server, which reads the context's gradients (dist_autograd.get_gradients), adds them to the round's sum, and when every
trainer has submitted averages them, takes one SGD step (momentum 0.9, as Tandem's server) and answers them all: the
same synchronous rounds as Tandem's parameter-server example, with nothing serialised but the step. Tandem's server
takes the round inside the backward pass (a backward-part hook, dist_autograd.h: the reply to the gradient message waits
for the round), saving the submit message; PyTorch's distributed autograd has no such hook (a parameter's tensor hook
cannot hold the reply back without blocking the autograd engine's one CPU thread, which the other trainer's backward
needs), so its trainers keep the submit call.

--design tutorial: PyTorch's parameter-server tutorial ("Implementing a Parameter Server Using Distributed RPC
Framework"): a DistributedOptimizer (SGD) over the server's parameter RRefs; with two concurrent trainers that design
fails (one trainer's in-place update changes weights the other's backward saved: "modified by an inplace operation"),
so a lock on the server serialises whole steps (impl "torch_tutorial").

ps_steps_per_s is the sum over trainers of each one's steps per second.

  python3 bench/peer_ps.py default|tcp [--steps N] [--design sync|tutorial] [--server-threads N]
"""
import os
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


TRAINERS = 2
_round = {"sum": None, "waiting": []}


def _server_optimizer():
    if "opt" not in _server:
        _server["params"] = list(get_model().parameters())
        _server["opt"] = torch.optim.SGD(_server["params"], lr=0.01, momentum=0.9)
    return _server["opt"]


@rpc.functions.async_execution
def submit(cid):
    """A trainer's gradients of context `cid` into the round; the last one's submit steps once and answers all."""
    grads = dist_autograd.get_gradients(cid)
    done = torch.futures.Future()
    answer = []
    with _lock:
        opt = _server_optimizer()
        params = _server["params"]
        if _round["sum"] is None:
            _round["sum"] = [None] * len(params)
        total = _round["sum"]
        for i, p in enumerate(params):
            g = grads.get(p)
            if g is not None:
                # The first trainer's gradient becomes the sum in place, as on Tandem's server: its context lives
                # until this round is over, and nothing else reads it.
                total[i] = g if total[i] is None else total[i].add_(g)
        _round["waiting"].append(done)
        if len(_round["waiting"]) == TRAINERS:
            for p, g in zip(params, total):
                p.grad = None if g is None else g.div_(TRAINERS)
            opt.step()
            for p in params:
                p.grad = None
            _round["sum"] = None
            answer, _round["waiting"] = _round["waiting"], []
    for f in answer:
        f.set_result(None)
    return done


_rates = []


def finished(rate):
    _rates.append(rate)
    _done.release()


def run(rank, port, args):
    # The server's RPC threads as Tandem's side has them (--server-threads, both sides: the machine's cores by default);
    # the trainers keep PyTorch's default 16, and so does the tutorial's server, whose lock parks a thread per waiting
    # trainer (with 2, the trainer holding the lock would have one thread left for its calls).
    tutorial = args.design == "tutorial"
    server_threads = 16 if tutorial else args.server_threads
    impl = init(rank, 3, port, args.mode, server_threads if rank == 0 else 16)
    if rank == 0:
        get_model()
        _server_optimizer()
        for _ in range(TRAINERS):
            _done.acquire(timeout=1800)
        emit_line("ps", impl + ("_tutorial" if tutorial else ""), "ps_steps_per_s", sum(_rates), "steps/s",
                  processes=3, trainers=TRAINERS, model="mlp784-512-512-10", batch=64,
                  mode="locked steps" if tutorial else "sync", steps_per_trainer=args.steps,
                  server_worker_threads=server_threads)
    else:
        opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("w0", param_rrefs), lr=0.01) if tutorial else None
        x = torch.randn(64, 784)
        y = torch.randint(0, 10, (64,))
        warmup = args.steps // 10
        for s in range(warmup + args.steps):
            if s == warmup:
                t0 = time.perf_counter()
            if tutorial:
                rpc.rpc_sync("w0", acquire)
                try:
                    with dist_autograd.context() as cid:
                        loss = F.cross_entropy(rpc.rpc_sync("w0", forward, args=(x,)), y)
                        dist_autograd.backward(cid, [loss])
                        opt.step(cid)
                finally:
                    rpc.rpc_sync("w0", release)
            else:
                with dist_autograd.context() as cid:
                    loss = F.cross_entropy(rpc.rpc_sync("w0", forward, args=(x,)), y)
                    dist_autograd.backward(cid, [loss])
                    rpc.rpc_sync("w0", submit, args=(cid,))
        rpc.rpc_sync("w0", finished, args=(args.steps / (time.perf_counter() - t0),))
    rpc.shutdown()


if __name__ == "__main__":
    # --server-threads: as Tandem's examples::default_server_threads() (the CPUs, at least 2); --trace is Tandem's side's
    # (bench/run.sh passes its flags to both), accepted and unused here.
    peer_main(__file__, run, 3, {"--steps": 2000, "--design": "sync",
                                 "--server-threads": max(2, len(os.sched_getaffinity(0))), "--trace": ""})
