"""bench/run.sh hybrid -- the PyTorch peer: hybrid data + model parallelism, the design of PyTorch's tutorial "Combining
Distributed DataParallel with Distributed RPC Framework" (pytorch/examples distributed/rpc/ddp_rpc/main.py), with
PyTorch's defaults: TensorPipe (defaults, or TCP forced) with 16 RPC threads as set by peer_common.init, and Gloo DDP
with its default buckets.

4 processes: w0 the master, w1 and w2 the trainers, w3 the parameter server. The master creates
RemoteModule("w3/cpu", nn.EmbeddingBag(1568, 64, mode="sum")) and starts both trainers over RPC. Each trainer wraps a
dense Linear(64,128)-ReLU-Linear(128,10) in DistributedDataParallel over the trainers' own Gloo group of 2, and steps a
DistributedOptimizer (SGD, lr 0.05) over the embedding's remote parameters plus its local DDP parameters. One iteration,
on a fixed batch of 64 bags of 196 token ids: under a dist_autograd context, the remote embedding's forward, the DDP
forward, cross entropy, dist_autograd.backward (DDP's allreduce among the trainers, the embedding's gradient sent back
to w3), opt.step. After 5 untimed warm-up iterations each trainer returns its median over --iters; the master emits
hybrid_iter_ms, the slower trainer's median.

  python3 bench/peer_hybrid.py default|tcp [--iters N]
"""
import os

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

from peer_common import emit, init, main as peer_main, median_time

BATCH, BAG, EMBEDDINGS, DIM, CLASSES = 64, 196, 1568, 64, 10
WARMUP = 5


def _run_trainer(remote_emb_module, rank, iters):
    """Runs on w1/w2 (an RPC target): trains the hybrid model, returns the median iteration time in ms."""
    torch.manual_seed(0)
    ddp_model = DDP(nn.Sequential(nn.Linear(DIM, 128), nn.ReLU(), nn.Linear(128, CLASSES)))
    model_parameter_rrefs = remote_emb_module.remote_parameters() + [RRef(p) for p in ddp_model.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, model_parameter_rrefs, lr=0.05)

    torch.manual_seed(100 + rank)
    ids = torch.randint(0, EMBEDDINGS, (BATCH * BAG,))
    offsets = torch.arange(0, BATCH * BAG, BAG)
    target = torch.randint(0, CLASSES, (BATCH,))

    def step():
        with dist_autograd.context() as cid:
            emb = remote_emb_module.forward(ids, offsets)
            out = ddp_model(emb)
            loss = F.cross_entropy(out, target)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
    return median_time(iters, WARMUP, step, scale=1e3)


def run(rank, port, args):
    if rank in (1, 2):
        # As in the tutorial: the trainers form their DDP process group before joining RPC.
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + 1}", rank=rank - 1, world_size=2)
    impl = init(rank, 4, port, args.mode)
    if rank == 0:
        remote_emb_module = RemoteModule("w3/cpu", nn.EmbeddingBag, args=(EMBEDDINGS, DIM), kwargs={"mode": "sum"})
        futs = [rpc.rpc_async(f"w{r}", _run_trainer, args=(remote_emb_module, r, args.iters)) for r in (1, 2)]
        m1, m2 = [f.wait() for f in futs]
        emit("hybrid", impl, "hybrid_iter_ms", max(m1, m2), "ms", processes=4, trainers=2, batch=BATCH, bag=BAG,
             embeddings=EMBEDDINGS, dim=DIM, iters=args.iters, trainer_ms=[round(m1, 3), round(m2, 3)])
    rpc.shutdown()
    if rank in (1, 2):
        dist.destroy_process_group()


if __name__ == "__main__":
    peer_main(__file__, run, 4, {"--iters": 50})
