"""bench/run.sh ddp -- the PyTorch peer: the workload of bench/ddp_bench.cc on torch.nn.parallel.DistributedDataParallel
over its Gloo process group (2 ranks, one intra-op thread each, loopback interface like ours).

  python3 bench/peer_ddp.py default [--iters N --sweep 0|1]
"""
import os
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from peer_common import emit, main as peer_main, median_time


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 1024))


def time_iters(iters, net, x, y):
    """Median milliseconds of a training iteration of `net` (after 3 warm-up ones)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return median_time(iters, 3, step, scale=1e3)


def run(rank, port, args):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    params = sum(p.numel() for p in make_model().parameters())
    cond = dict(processes=2, model="mlp1024-2048-2048-1024", params=params, batch_per_rank=64, iters=args.iters)
    local_ms = 0
    if rank == 0:
        local_ms = time_iters(args.iters, make_model(), x, y)
        emit("ddp", "torch", "local_iter_ms", local_ms, "ms", processes_running=1, **cond)
    dist.barrier()
    # 25 MiB with PyTorch's default (gradient_as_bucket_view=False) and with it True (Tandem's default); the sweep of
    # caps with it True, as Tandem's sweep runs (no copy of every gradient into its bucket: PyTorch's faster setting).
    configs = [(25, False), (25, True)] + ([(1, True), (5, True), (100, True), (1000, True)] if args.sweep else [])
    for cap, view in configs:
        ms = time_iters(args.iters, DDP(make_model(), bucket_cap_mb=cap, gradient_as_bucket_view=view), x, y)
        if rank == 0:
            emit("ddp", "torch", "ddp_iter_ms", ms, "ms", bucket_cap_mb=cap, gradient_as_bucket_view=view,
                 weak_scaling_efficiency=round(local_ms / ms, 3), **cond)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    peer_main(__file__, run, 2, {"--iters": 30, "--sweep": 1})
