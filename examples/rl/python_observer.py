#!/usr/bin/python3
"""A Python observer feeding a C++ agent (examples/rl/python_agent.cc) over Tandem's wire (clients/python).

The observer plays CartPole-v1 here, in Python and NumPy; for every step it sends the observation to the agent, which
answers the action from its policy; after every episode it sends the rewards, and the agent learns (REINFORCE). It
stops when the running reward (0.05 r + 0.95 running) passes --target, or after --episodes.

    export TANDEM_SECRET=$(openssl rand -hex 32)
    build/tandem-run --nproc-per-node 1 build/rl_python_agent --address-file /tmp/agent.addr &
    PYTHONPATH=build/python python3 examples/rl/python_observer.py --address-file /tmp/agent.addr

Exit status: 0 when solved (or --episodes were played), 1 when not solved within --max-episodes, 2 on an error.
"""

import argparse
import math
import os
import sys
import time

import numpy as np

import tandem_client


class CartPole:
    """CartPole-v1 as examples/rl/cartpole.cc has it (gym's dynamics, Euler integration, 500 steps at most)."""

    GRAVITY, MASS_CART, MASS_POLE, LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    THETA_LIMIT, X_LIMIT, MAX_STEPS = 12 * 2 * math.pi / 360, 2.4, 500

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.state = np.zeros(4)
        self.steps = 0

    def reset(self):
        self.state = self.rng.uniform(-0.05, 0.05, size=4)
        self.steps = 0
        return self.state.copy()

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        total = self.MASS_CART + self.MASS_POLE
        pole_ml = self.MASS_POLE * self.LENGTH
        force = self.FORCE if action == 1 else -self.FORCE
        cos_t, sin_t = math.cos(theta), math.sin(theta)
        temp = (force + pole_ml * theta_dot * theta_dot * sin_t) / total
        theta_acc = (self.GRAVITY * sin_t - cos_t * temp) / (
            self.LENGTH * (4.0 / 3.0 - self.MASS_POLE * cos_t * cos_t / total))
        x_acc = temp - pole_ml * theta_acc * cos_t / total
        self.state = np.array([x + self.TAU * x_dot, x_dot + self.TAU * x_acc, theta + self.TAU * theta_dot,
                               theta_dot + self.TAU * theta_acc])
        self.steps += 1
        x, _, theta, _ = self.state
        fell = abs(x) > self.X_LIMIT or abs(theta) > self.THETA_LIMIT
        return self.state.copy(), 1.0, fell or self.steps >= self.MAX_STEPS


def wait_for_file(path, seconds):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no agent address in '{path}' within {seconds} s (is rl_python_agent running?)")
        time.sleep(0.05)
    with open(path) as f:
        return f.read().strip()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--master", help="the agent job's master, host:port (or MASTER_ADDR and MASTER_PORT)")
    p.add_argument("--address-file", help="read the master from this file (rl_python_agent --address-file)")
    p.add_argument("--wait", type=float, default=60, help="seconds to wait for the address file")
    p.add_argument("--agent", default="0", help="the agent worker's rank or name")
    p.add_argument("--seed", type=int, default=0, help="seed of the environment and of the action draws")
    p.add_argument("--target", type=float, default=475, help="stop when the running reward passes it")
    p.add_argument("--max-episodes", type=int, default=1000, help="give up (exit 1) after this many episodes")
    p.add_argument("--episodes", type=int, default=0, help="play exactly this many episodes, then stop (exit 0)")
    p.add_argument("--keep-agent", action="store_true", help="do not stop the agent at the end")
    args = p.parse_args()

    master = args.master
    if args.address_file:
        master = wait_for_file(args.address_file, args.wait)
    with tandem_client.Client(master, name="python-observer", timeout=30) as job:
        wanted = int(args.agent) if args.agent.isdigit() else args.agent
        agent = next((w for w in job.workers() if wanted in (w.rank, w.name)), None)
        if agent is None:
            raise ValueError(f"no worker {args.agent} in the job at {master}")
        print(f"observer: joined the job at {master}; the agent is worker '{agent.name}'", flush=True)
        env = CartPole(args.seed)
        draws = np.random.default_rng(args.seed + 1)
        running, steps, t0 = 10.0, 0, time.monotonic()
        limit = args.episodes or args.max_episodes
        solved = False
        for episode in range(1, limit + 1):
            observation, rewards, done = env.reset(), [], False
            while not done:
                action = job.call(agent, "agent.act", observation, float(draws.random()))
                observation, reward, done = env.step(action)
                rewards.append(reward)
            loss = job.call(agent, "agent.finish_episode", np.array(rewards))
            steps += len(rewards)
            running = 0.05 * sum(rewards) + 0.95 * running
            if episode % 10 == 0 or args.episodes:
                secs = time.monotonic() - t0
                print(f"episode {episode}  reward {sum(rewards):.0f}  running reward {running:.1f}  loss {loss:.3f}  "
                      f"{steps / secs:.0f} steps/s", flush=True)
            if not args.episodes and running > args.target:
                print(f"solved after {episode} episodes ({time.monotonic() - t0:.0f} s): running reward "
                      f"{running:.1f} > {args.target:g}", flush=True)
                solved = True
                break
        if not args.keep_agent:
            job.call(agent, "agent.stop")
    if args.episodes or solved:
        return 0
    print(f"observer: not solved within {args.max_episodes} episodes (running reward {running:.1f})",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (tandem_client.TandemError, TimeoutError, ValueError) as e:
        print(f"observer: {e}", file=sys.stderr)
        sys.exit(2)
