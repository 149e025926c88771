"""bench/run.sh rl -- the PyTorch peer: REINFORCE on CartPole-v1 in the design of PyTorch's RPC reinforcement-learning
tutorial, batch variant (pytorch/examples distributed/rpc/batch/reinforce.py, "Implementing Batch RPC Processing Using
Asynchronous Executions"): one Agent on w0 holds the policy behind an RRef and creates the observers with rpc.remote;
each round it calls run_episode with rpc_async on every observer; each observer step is an rpc_sync of the
@rpc.functions.async_execution Agent.select_action_batch, which stores the state in row observer_id and, once every
observer of the step has arrived (lock, pending counter), runs ONE policy forward and completes the shared Future that
each caller's future maps to its own action. TensorPipe defaults (or TCP forced) with 16 RPC threads (peer_common.init).

The workload, shared with Tandem's side: gym's CartPole-v1 dynamics in pure Python (Euler, 500-step cut, resets drawn
uniform in [-0.05, 0.05) from the observer's random.Random(seed*1000 + observer_id), observer_id 0-based); policy
Linear(4,128)-ReLU-Linear(128,2)-softmax after torch.manual_seed(seed), Adam lr 1e-2, gamma 0.99; action 0 if u < p0
else 1 with u the observer's draw after the state; after each round one REINFORCE update over all observers' returns
(restarting at each episode end, normalised together), loss -sum(log_prob * R).

- rl_env_steps_per_s, select_action_p50_us: N = 1, 4, 10 observers (w1..wN), every observer exactly --steps env steps
  per round (resetting when an episode ends), --rounds timed rounds after one warm-up round; the p50 is over every
  observer's select_action round trips.
- rl_episodes_to_solve(_seed): seeds 0..--solve-seeds-1, one observer, one full episode per round, running reward
  (from 10, 0.05 per episode) above 475; --max-episodes counted when it never gets there.

  python3 bench/peer_rl.py default|tcp [--rounds N --steps N --solve-seeds N --max-episodes N]
"""
import math
import random
import statistics
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import RRef

from peer_common import emit as emit_line, init, main as peer_main

GAMMA, MAX_EPISODE_STEPS, SOLVED_REWARD = 0.99, 500, 475
GRAVITY, MASSCART, MASSPOLE, LENGTH, FORCE_MAG, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
TOTAL_MASS, POLEMASS_LENGTH = MASSPOLE + MASSCART, MASSPOLE * LENGTH
X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * math.pi / 360


class CartPole:
    """gym's CartPoleEnv.step (Euler) with the TimeLimit of CartPole-v1; reward 1 per step."""

    def __init__(self, rng):
        self.rng = rng

    def reset(self):
        self.state, self.t = [-0.05 + 0.1 * self.rng.random() for _ in range(4)], 0
        return self.state

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = FORCE_MAG if action == 1 else -FORCE_MAG
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + POLEMASS_LENGTH * theta_dot ** 2 * sin) / TOTAL_MASS
        thetaacc = (GRAVITY * sin - cos * temp) / (LENGTH * (4.0 / 3.0 - MASSPOLE * cos ** 2 / TOTAL_MASS))
        xacc = temp - POLEMASS_LENGTH * thetaacc * cos / TOTAL_MASS
        x, x_dot = x + TAU * x_dot, x_dot + TAU * xacc
        theta, theta_dot = theta + TAU * theta_dot, theta_dot + TAU * thetaacc
        self.state, self.t = [x, x_dot, theta, theta_dot], self.t + 1
        done = abs(x) > X_LIMIT or abs(theta) > THETA_LIMIT or self.t >= MAX_EPISODE_STEPS
        return self.state, 1.0, done


class Observer:
    def __init__(self, ob_id, seed):
        self.id, self.rng = ob_id, random.Random(seed * 1000 + ob_id)
        self.env = CartPole(self.rng)

    def run_episode(self, agent_rref, n_steps):
        """Exactly n_steps env steps (resetting at each episode end), or with n_steps 0 one full episode. Returns the
        rewards, the episode-end flags and each select_action round trip in us."""
        state, rewards, dones, rtts = self.env.reset(), [], [], []
        while True:
            args = (agent_rref, self.id, torch.tensor(state), self.rng.random())
            t0 = time.perf_counter()
            action = rpc.rpc_sync(agent_rref.owner(), Agent.select_action_batch, args=args)
            rtts.append((time.perf_counter() - t0) * 1e6)
            state, reward, done = self.env.step(action)
            rewards.append(reward)
            dones.append(done)
            if len(rewards) == n_steps or (done and n_steps == 0):
                return rewards, dones, rtts
            if done:
                state = self.env.reset()


class Agent:
    def __init__(self, n, seed):
        torch.manual_seed(seed)
        self.policy = nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 2))
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.rref = RRef(self)
        self.ob_rrefs = [rpc.remote(f"w{i + 1}", Observer, args=(i, seed)) for i in range(n)]
        self.states, self.us = torch.zeros(n, 4), [0.0] * n
        self.log_probs = [[] for _ in range(n)]
        self.lock = threading.Lock()
        self.pending = n
        self.future_actions = torch.futures.Future()

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref, ob_id, state, u):
        self = agent_rref.local_value()
        self.states[ob_id].copy_(state)
        self.us[ob_id] = u
        future_action = self.future_actions.then(lambda fut: fut.wait()[ob_id])
        with self.lock:
            self.pending -= 1
            if self.pending == 0:
                self.pending = len(self.ob_rrefs)
                # A copy: autograd keeps the forward's input, and the next step writes self.states in place.
                probs = torch.softmax(self.policy(self.states.clone()), dim=1)
                actions = [0 if u < p0 else 1 for u, p0 in zip(self.us, probs[:, 0].tolist())]
                for i, a in enumerate(actions):
                    self.log_probs[i].append(probs[i, a].log())
                future_actions, self.future_actions = self.future_actions, torch.futures.Future()
                future_actions.set_result(actions)
        return future_action

    def run_round(self, n_steps):
        """One round on every observer, then the REINFORCE update; returns the observers' (rewards, dones, rtts)."""
        rets = torch.futures.wait_all([ob.rpc_async().run_episode(self.rref, n_steps) for ob in self.ob_rrefs])
        returns = []
        for rewards, dones, _ in rets:
            R, rs = 0.0, []
            for r, done in zip(reversed(rewards), reversed(dones)):
                R = r + GAMMA * (0.0 if done else R)
                rs.append(R)
            returns += reversed(rs)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + 1e-8)
        loss = -(torch.stack([lp for lps in self.log_probs for lp in lps]) * returns).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.log_probs = [[] for _ in self.ob_rrefs]
        return rets


def episodes_to_solve(seed, max_episodes):
    agent, running = Agent(1, seed), 10.0
    for episode in range(1, max_episodes + 1):
        (rewards, _, _), = agent.run_round(0)
        running = 0.05 * sum(rewards) + 0.95 * running
        if running > SOLVED_REWARD:
            return episode, True
    return max_episodes, False


def run(rank, port, args):
    impl = init(rank, 11, port, args.mode)
    if rank == 0:
        for n in (1, 4, 10):
            agent = Agent(n, 0)
            agent.run_round(args.steps)
            rtts = []
            t0 = time.perf_counter()
            for _ in range(args.rounds):
                rtts += [d for _, _, ds in agent.run_round(args.steps) for d in ds]
            seconds = time.perf_counter() - t0
            emit_line("rl", impl, "rl_env_steps_per_s", n * args.steps * args.rounds / seconds, "steps/s",
                      processes=n + 1, observers=n, batched=True, rounds=args.rounds, steps=args.steps)
            emit_line("rl", impl, "select_action_p50_us", statistics.median(rtts), "us", processes=n + 1, observers=n,
                      batched=True)
        results = []
        for seed in range(args.solve_seeds):
            episodes, solved = episodes_to_solve(seed, args.max_episodes)
            results.append((episodes, solved))
            emit_line("rl", impl, "rl_episodes_to_solve_seed", episodes, "episodes", processes=2, observers=1,
                      seed=seed, solved=solved)
        if results:
            emit_line("rl", impl, "rl_episodes_to_solve", statistics.median([e for e, _ in results]), "episodes",
                      processes=2, observers=1, seeds=len(results), solved_all=all(s for _, s in results))
    rpc.shutdown()


if __name__ == "__main__":
    peer_main(__file__, run, 11, {"--rounds": 20, "--steps": 100, "--solve-seeds": 5, "--max-episodes": 3000})
