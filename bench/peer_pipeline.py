"""bench/run.sh pipeline -- the PyTorch peer: the design of PyTorch's RPC pipeline tutorial (pytorch/examples
distributed/rpc/pipeline, "Distributed Pipeline Parallelism Using RPC"): each stage's shard lives on a worker behind an
RRef and runs its forward under a threading.Lock; the driver (w0) splits the batch into m micro-batches and, for each,
issues x_rref = RRef(x_mb); y_rref = shard1.remote().forward(x_rref); z_fut = shard2.rpc_async().forward(y_rref), all
before waiting; then torch.cat of the futures' results, the loss on the driver, one dist_autograd.backward and a
DistributedOptimizer (SGD, lr 0.01) step over every shard's parameter RRefs. This is PyTorch's best available RPC
configuration for it: TensorPipe defaults (or TCP forced) with 16 RPC threads, as set by peer_common.init.

- pipeline_step_ms: 2 stages on w1, w2, each Linear(d,d)-ReLU-Linear(d,d)-ReLU, MSE loss against a random target,
  m in 1, 2, 4, 8 (torch.tensor_split), sizes small (d 256, batch 128) and large (d 1024, batch 1024); median over
  --steps steps after 2 warm-up ones. pipeline_local_step_ms: the same unsplit model on the driver, local autograd.
- pipeline_bubble_ratio: 4 stages on w1..w4 whose forward sleeps --tf-ms and whose backward sleeps --tb-ms (a scalar
  weight gives the optimizer something to step), m 8, input 16x8; median step time over the ideal (m+p-1)(tf+tb).

  python3 bench/peer_pipeline.py default|tcp [--steps N --tf-ms N --tb-ms N --tw-ms N --parts small,large,bubble]
"""
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

from peer_common import emit as emit_line, init, main as peer_main, median_time

SIZES = [("small", 256, 128), ("large", 1024, 1024)]


def mlp(d, stages):
    return nn.Sequential(*[layer for _ in range(2 * stages) for layer in (nn.Linear(d, d), nn.ReLU())])


class Shard(nn.Module):
    """The tutorial's shard base: a lock around forward and the parameters' RRefs."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


class MLPShard(Shard):
    def __init__(self, d):
        super().__init__()
        torch.manual_seed(0)
        self.net = mlp(d, 1)

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            return self.net(x)


class SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tb):
        ctx.tb = tb
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.tb)
        return grad, None


class SleepShard(Shard):
    def __init__(self, tf_ms, tb_ms):
        super().__init__()
        self.tf, self.tb = tf_ms / 1000, tb_ms / 1000
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            time.sleep(self.tf)
            return SleepBackward.apply(x * self.w, self.tb)


def make_step(shards, x, target, m, loss_fn):
    """One training step of the tutorial's DistModel: the chain of RRefs per micro-batch, one backward, one step."""
    opt = DistributedOptimizer(torch.optim.SGD, [p for s in shards for p in s.remote().parameter_rrefs().to_here()],
                               lr=0.01)

    def step():
        with dist_autograd.context() as cid:
            futs = []
            for x_mb in torch.tensor_split(x, m):
                ref = RRef(x_mb)
                for s in shards[:-1]:
                    ref = s.remote().forward(ref)
                futs.append(shards[-1].rpc_async().forward(ref))
            loss = loss_fn(torch.cat(torch.futures.wait_all(futs)), target)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
    return step


def run(rank, port, args):
    impl = init(rank, 5, port, args.mode)
    if rank == 0:
        parts = args.parts.split(",")
        for size, d, batch in [s for s in SIZES if s[0] in parts]:
            torch.manual_seed(0)
            x, target = torch.randn(batch, d), torch.randn(batch, d)
            shards = [rpc.remote(w, MLPShard, args=(d,)) for w in ("w1", "w2")]
            for m in (1, 2, 4, 8):
                ms = median_time(args.steps, 2, make_step(shards, x, target, m, F.mse_loss), scale=1e3)
                emit_line("pipeline", impl, "pipeline_step_ms", ms, "ms", processes=3, size=size, m=m,
                          schedule="rpc_tutorial", dim=d, batch=batch, steps=args.steps)
            torch.manual_seed(0)
            local = mlp(d, 2)
            opt = torch.optim.SGD(local.parameters(), lr=0.01)

            def local_step():
                opt.zero_grad()
                F.mse_loss(local(x), target).backward()
                opt.step()
            ms = median_time(args.steps, 2, local_step, scale=1e3)
            emit_line("pipeline", impl, "pipeline_local_step_ms", ms, "ms", processes=1, size=size, dim=d,
                      batch=batch, steps=args.steps)
        p, m, tf, tb = 4, 8, args.tf_ms, args.tb_ms
        if "bubble" not in parts:
            rpc.shutdown()
            return
        shards = [rpc.remote(f"w{r}", SleepShard, args=(tf, tb)) for r in range(1, p + 1)]
        step = make_step(shards, torch.randn(16, 8), None, m, lambda out, _: out.sum())
        step_ms = median_time(args.steps, 1, step, scale=1e3)
        ideal_ms = (m + p - 1) * (tf + tb)
        emit_line("pipeline", impl, "pipeline_bubble_ratio", step_ms / ideal_ms, "x", processes=5,
                  schedule="rpc_tutorial", p=p, m=m, tf_ms=tf, tb_ms=tb, step_ms=round(step_ms, 3), ideal_ms=ideal_ms)
    rpc.shutdown()


if __name__ == "__main__":
    # --tw-ms is Tandem's (the weights' share of a split backward): PyTorch's RPC pipeline runs full backwards only.
    peer_main(__file__, run, 5,
              {"--steps": 10, "--tf-ms": 20, "--tb-ms": 40, "--tw-ms": 20, "--parts": "small,large,bubble"})
