"""bench/run.sh fsdp -- the PyTorch peer: the workload of bench/fsdp_bench.cc (the DDP benchmark's MLP, Adam, batch 64
per rank, 2 ranks, one intra-op thread each) on torch.nn.parallel.DistributedDataParallel over Gloo, with Adam
(--config ddp) or with torch.distributed.optim.ZeroRedundancyOptimizer(Adam) (--config zero1: optimizer state sharded).
PyTorch 1.13's FullyShardedDataParallel does not import under Debian 12's Python 3.11 (a dataclass ValueError in
torch.distributed._shard.sharded_tensor.metadata), so ZeRO-1 is the most PyTorch shards here. Peak memory as Tandem's
side measures it, the largest rank's (each rank's beside it): a rank's VmHWM over the timed iterations (reset through
/proc/self/clear_refs) above its VmRSS before the model was built, and own_peak_mib without file-backed pages (VmHWM
less RssFile when the timed iterations began, above VmRSS less RssFile before the model was built).

--trim 1: malloc_trim(0) after each step, as Tandem's lean mode (bench/run.sh fsdp runs each configuration both ways).

  python3 bench/peer_fsdp.py default --config ddp|zero1 [--iters N] [--trim 0|1]
"""
import ctypes
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from peer_common import emit, main as peer_main, median_time


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def run(rank, port, args):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    before, before_file = status_kib("VmRSS"), status_kib("RssFile")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
    params = sum(p.numel() for p in model.parameters())
    # Gradients as views of the buckets (Tandem's ddp mode does the same): PyTorch's default copies each into a
    # .grad of its own, 4 bytes per parameter more at the peak and a copy per iteration.
    net = DDP(model, gradient_as_bucket_view=True)
    if args.config == "zero1":
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    else:
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)

    trim = ctypes.CDLL("libc.so.6").malloc_trim if args.trim else None

    def step():
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
        if trim:
            trim(0)  # malloc's free pages back to the kernel after each step, as Tandem's lean mode does
    for _ in range(3):
        step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset_file = status_kib("RssFile")
    ms = median_time(args.iters, 0, step, scale=1e3)
    hwm, file_growth = status_kib("VmHWM"), status_kib("RssFile") - reset_file
    peak = (hwm - before) / 1024
    own_peak = ((hwm - reset_file) - (before - before_file)) / 1024
    mine = torch.tensor([peak, own_peak, float(file_growth)], dtype=torch.float64)
    every = [torch.empty(3, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(every, mine)
    if rank == 0:
        peak, own_peak = (max(t[k].item() for t in every) for k in range(2))
        file_growth = min(t[2].item() for t in every)  # negative on any rank would void own_peak's bound
        rank_peaks = [[round(t[k].item(), 3) for t in every] for k in range(2)]
        mib = 4 / (1 << 20)
        state = 4 * params * mib if args.config == "ddp" else (2 * params + 2 * params / 2) * mib
        cond = dict(processes=2, model="mlp1024-2048-2048-1024", params=params, optimizer="adam", batch_per_rank=64,
                    mode=args.config, iters=args.iters, gradient_as_bucket_view=True, malloc_trim=bool(args.trim))
        emit("fsdp", "torch", "fsdp_iter_ms", ms, "ms", **cond)
        emit("fsdp", "torch", "fsdp_peak_mib", peak, "MiB", model_state_mib=round(state, 3),
             own_peak_mib=round(own_peak, 3), file_growth_kib=file_growth, rank_peak_mib=rank_peaks[0],
             rank_own_peak_mib=rank_peaks[1], **cond)
    dist.destroy_process_group()


if __name__ == "__main__":
    peer_main(__file__, run, 2, {"--iters": 20, "--config": "ddp", "--trim": 0})
