"""bench/run.sh collectives -- the PyTorch peer: the workload of bench/collectives_bench.cc on torch.distributed with
its Gloo process group (2 ranks, TCP rendezvous, loopback interface like ours).

  python3 bench/peer_collectives.py default [--iters N]
"""
import os
import torch
import torch.distributed as dist

from peer_common import emit, main as peer_main, master_addr, median_time


def time_op(iters, op):
    dist.barrier()
    return median_time(iters, max(1, iters // 10), lambda: op().wait())


def run(rank, port, args):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://{master_addr()}:{port}", rank=rank, world_size=2)
    n = dist.get_world_size()
    factor = 2.0 * (n - 1) / n
    tiny, mib, big = torch.ones(1), torch.ones(1 << 18), torch.ones(16 << 20)
    it = args.iters
    t_tiny = time_op(it * 100, lambda: dist.all_reduce(tiny, async_op=True))
    t_mib = time_op(it * 10, lambda: dist.all_reduce(mib, async_op=True))
    t_big = time_op(it, lambda: dist.all_reduce(big, async_op=True))
    t_bcast = time_op(it, lambda: dist.broadcast(big, 0, async_op=True))
    if rank == 0:
        cond = dict(processes=n, backend="gloo")
        nbytes = lambda t: t.numel() * t.element_size()
        emit("collectives", "torch", "allreduce_4B_us", t_tiny, "us", iters=it * 100, **cond)
        emit("collectives", "torch", "allreduce_1MiB_busbw_GBps", factor * nbytes(mib) / t_mib / 1e3, "GB/s",
             iters=it * 10, **cond)
        emit("collectives", "torch", "allreduce_64MiB_busbw_GBps", factor * nbytes(big) / t_big / 1e3, "GB/s",
             iters=it, median_ms=round(t_big / 1e3, 3), **cond)
        emit("collectives", "torch", "broadcast_64MiB_GBps", nbytes(big) / t_bcast / 1e3, "GB/s", iters=it, **cond)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    peer_main(__file__, run, 2, {"--iters": 20})
