"""Shared by the PyTorch peer scripts of bench/run.sh: process launch, RPC init, and the JSON line format."""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed.rpc as rpc


def emit(bench, impl, metric, value, unit, processes, **extra):
    print(json.dumps({"bench": bench, "impl": impl, "metric": metric, "value": round(value, 3), "unit": unit,
                      "processes": processes, "intra_op_threads": 1, **extra}), flush=True)


def median_time(iters, warmup, fn, scale=1e6):
    """Median duration of `iters` calls of fn() after `warmup` untimed ones, in seconds times `scale` (us default)."""
    t = []
    for i in range(iters + warmup):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            t.append((time.perf_counter() - t0) * scale)
    return statistics.median(t)


def master_addr():
    """Where rank 0 serves the job's store: TANDEM_BENCH_MASTER_ADDR (bench/run.sh hosts: host 0's address), else
    127.0.0.1."""
    return os.environ.get("TANDEM_BENCH_MASTER_ADDR", "127.0.0.1")


def init(rank, world, port, mode, worker_threads=16):
    """Joins a torch.distributed.rpc job as w<rank> with `worker_threads` RPC threads (PyTorch's default 16); mode
    "default" or "tcp" (TensorPipe's TCP transport forced). Returns the impl name used in the JSON lines."""
    torch.set_num_threads(1)
    # The transports and channels go to the constructor: they are not attributes of the options (assigning
    # opts._channels afterwards only makes a Python attribute that TensorPipe never reads, and "tcp" then ran with
    # every channel, CMA included).
    forced = {"_transports": ["uv"], "_channels": ["basic"]} if mode == "tcp" else {}
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=worker_threads, rpc_timeout=120,
                                           init_method=f"tcp://{master_addr()}:{port}", **forced)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    return "torch" if mode == "default" else "torch_tcp"


def bind_cores(rank, world):
    """With BIND_CORES=1 (bench/run.sh), what binds rank `rank` of `world` to the CPUs tandem-run --bind-cores 1 would
    give it: its block of this process's CPUs when there are at least `world`, else CPU rank mod their count."""
    if os.environ.get("BIND_CORES") != "1":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus)
    mine = {cpus[rank % n]} if n < world else set(cpus[rank * n // world:(rank + 1) * n // world])
    return lambda: os.sched_setaffinity(0, mine)


def launch(script, argv, world):
    """Runs `world` copies of `script` with `argv` plus --port and --rank; exits non-zero if any rank fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = [sys.executable, script] + argv + ["--port", str(port)]
    procs = [subprocess.Popen(base + ["--rank", str(r)], env=env, preexec_fn=bind_cores(r, world)) for r in range(world)]
    # PyTorch's ranks hang when a peer dies: once one fails, stop the others.
    deadline = time.time() + 1800
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"{os.path.basename(script)}: ranks exited with {codes}")


def main(script, run, world, sizes):
    """The command line of a peer script: `mode` plus `sizes` ({flag: default}, each of its default's type); without
    --rank it launches the `world` ranks, with it it runs `run(rank, port, args)`."""
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["default", "tcp"])
    for flag, default in sizes.items():
        p.add_argument(flag, type=type(default), default=default)
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.rank >= 0:
        run(args.rank, args.port, args)
        return
    argv = [args.mode]
    for flag in sizes:
        argv += [flag, str(getattr(args, flag.lstrip("-").replace("-", "_")))]
    launch(script, argv, world)
