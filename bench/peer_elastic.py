"""bench/run.sh elastic — the worker of PyTorch's side, started by torchrun (python3 -m torch.distributed.run) under
bench/elastic_driver.py. The job of bench/elastic_bench.cc: MLP 784-256-10, SGD, batch 64 per rank of fixed random
data, one intra-op thread, DDP over Gloo; rank 0 saves a checkpoint every 10 steps (written aside, fsync'd, renamed, as
Tandem's Checkpointer does) and every rank resumes from the newest on start. Prints the same event lines."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def event(what, restart, step):
    print(json.dumps({"event": what, "restart": restart, "step": step, "t": time.time()}), flush=True)


def main():
    started = time.time()
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-ms", type=int, default=10)
    p.add_argument("--checkpoint-dir", default="/tmp/torch-elastic-bench")
    a, _ = p.parse_known_args()  # torchrun may add --local_rank
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(json.dumps({"event": "start", "restart": restart, "step": -1, "t": started}), flush=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    net = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

    step = 0
    os.makedirs(a.checkpoint_dir, exist_ok=True)
    saved = sorted(f for f in os.listdir(a.checkpoint_dir) if f.startswith("step-") and f.endswith(".pt"))
    if saved:
        state = torch.load(os.path.join(a.checkpoint_dir, saved[-1]))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]

    while step < a.steps:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        step += 1
        if rank == 0:
            event("step", restart, step)
            if step % 10 == 0:
                path = os.path.join(a.checkpoint_dir, f"step-{step:012d}.pt")
                with open(path + ".tmp", "wb") as f:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(path + ".tmp", path)
        time.sleep(a.step_ms / 1000)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
