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
- pipeline_replicated_step_ms: two replicas of the large 2-stage pipeline (w1-w2 and w3-w4), batch 1024 split in two
  shares, 4 micro-batches each, every micro-batch of both replicas issued before any is waited for, each replica's
  loss weighted by its share, one dist_autograd.backward; then each stage's gradients are summed across its replicas
  the way PyTorch 1.13 allows with RPC pipelines: the driver asks the 4 stage workers at once, each flattens its
  gradients in the context (dist_autograd.get_gradients), allreduces them over a Gloo group of the stage's two workers
  (torch.distributed, dist.new_group) and copies the sum back in place, before the DistributedOptimizer steps. There
  is no hook to start that sum during the backward, so it runs after it: reduction="after_backward". Beside it
  (replicas 1) one pipeline on w1-w2 with the whole batch in 8 micro-batches.

  python3 bench/peer_pipeline.py default|tcp [--steps N --tf-ms N --tb-ms N --tw-ms N
                                             --parts small,large,bubble,replicated]
"""
import os
import threading
import time

import torch
import torch.distributed as dist
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


_stage_group = None  # on a stage worker: the Gloo group of its stage's workers in both replicas


def sum_across_replicas(cid, shard_rref):
    """On a stage worker: its shard's gradients in context cid, summed over the stage's group, in place."""
    grads = dist_autograd.get_gradients(cid)
    mine = [grads[p] for p in shard_rref.local_value().parameters() if p in grads]
    bucket = torch.cat([g.reshape(-1) for g in mine])
    dist.all_reduce(bucket, group=_stage_group)
    at = 0
    for g in mine:
        g.copy_(bucket[at:at + g.numel()].view_as(g))
        at += g.numel()


def make_replicated_step(replicas, x, target, m):
    """Both replicas' micro-batches at once, one backward, then the sums across the replicas, then the step."""
    shards = [s for r in replicas for s in r]
    opt = DistributedOptimizer(torch.optim.SGD, [p for s in shards for p in s.remote().parameter_rrefs().to_here()],
                               lr=0.01)
    n = x.shape[0]

    def step():
        with dist_autograd.context() as cid:
            losses = []
            futs_by_replica = []
            shares = list(zip(torch.tensor_split(x, len(replicas)), torch.tensor_split(target, len(replicas))))
            for r, (xr, _) in enumerate(shares):
                futs = []
                for x_mb in torch.tensor_split(xr, m):
                    ref = RRef(x_mb)
                    for s in replicas[r][:-1]:
                        ref = s.remote().forward(ref)
                    futs.append(replicas[r][-1].rpc_async().forward(ref))
                futs_by_replica.append(futs)
            for r, (xr, yr) in enumerate(shares):
                out = torch.cat(torch.futures.wait_all(futs_by_replica[r]))
                losses.append(F.mse_loss(out, yr) * (xr.shape[0] / n))
            dist_autograd.backward(cid, [sum(losses)])
            torch.futures.wait_all([rpc.rpc_async(s.owner(), sum_across_replicas, args=(cid, s)) for s in shards])
            opt.step(cid)
    return step


def replicated(impl, args):
    """pipeline_replicated_step_ms (see the module's docstring); on the driver."""
    d, batch, m = 1024, 1024, 4
    torch.manual_seed(0)
    x, target = torch.randn(batch, d), torch.randn(batch, d)
    cond = dict(size="large", schedule="rpc_tutorial", stages=2, dim=d, batch=batch, steps=args.steps)
    one = [rpc.remote(w, MLPShard, args=(d,)) for w in ("w1", "w2")]
    ms = median_time(args.steps, 2, make_step(one, x, target, 2 * m, F.mse_loss), scale=1e3)
    emit_line("pipeline", impl, "pipeline_replicated_step_ms", ms, "ms", processes=3, replicas=1, m=2 * m, **cond)
    replicas = [[rpc.remote(w, MLPShard, args=(d,)) for w in pair] for pair in (("w1", "w2"), ("w3", "w4"))]
    ms2 = median_time(args.steps, 2, make_replicated_step(replicas, x, target, m), scale=1e3)
    emit_line("pipeline", impl, "pipeline_replicated_step_ms", ms2, "ms", processes=5, replicas=2, m=m,
              reduction="after_backward", vs_one_replica=round(ms2 / ms, 6), **cond)


def run(rank, port, args):
    global _stage_group
    impl = init(rank, 5, port, args.mode)
    parts = args.parts.split(",")
    if "replicated" in parts:
        # Every rank joins the default group and makes both stage groups (new_group is collective on all ranks).
        dist.init_process_group("gloo", init_method=f"file:///tmp/peer_pipeline_pg_{port}", rank=rank, world_size=5)
        stage0, stage1 = dist.new_group([1, 3]), dist.new_group([2, 4])
        _stage_group = {1: stage0, 3: stage0, 2: stage1, 4: stage1}.get(rank)
    if rank == 0:
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
        if "bubble" in parts:
            shards = [rpc.remote(f"w{r}", SleepShard, args=(tf, tb)) for r in range(1, p + 1)]
            step = make_step(shards, torch.randn(16, 8), None, m, lambda out, _: out.sum())
            step_ms = median_time(args.steps, 2, step, scale=1e3)  # 2 warm-up steps, as Tandem's side
            ideal_ms = (m + p - 1) * (tf + tb)
            emit_line("pipeline", impl, "pipeline_bubble_ratio", step_ms / ideal_ms, "x", processes=5,
                      schedule="rpc_tutorial", p=p, m=m, tf_ms=tf, tb_ms=tb, step_ms=round(step_ms, 3),
                      ideal_ms=ideal_ms)
        if "replicated" in parts:
            replicated(impl, args)
    rpc.shutdown()
    if "replicated" in parts:
        dist.destroy_process_group()
        if rank == 0:
            try:
                os.remove(f"/tmp/peer_pipeline_pg_{port}")
            except FileNotFoundError:
                pass


if __name__ == "__main__":
    # --tw-ms is Tandem's (the weights' share of a split backward): PyTorch's RPC pipeline runs full backwards only.
    peer_main(__file__, run, 5,
              {"--steps": 10, "--tf-ms": 20, "--tb-ms": 40, "--tw-ms": 20, "--parts": "small,large,bubble,replicated"})
