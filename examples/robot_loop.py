"""A fixed-rate robot control loop on a SmolVLA policy (random weights) with capsules.

    python examples/robot_loop.py [--policy DIR] [--hz 10] [--episodes 2] [--steps 30]

* A small simulated reaching task (written here; gymnasium-style reset/step) renders camera
  images and joint states as LeRobot observations; the policy's actions move the joints.
* The loop runs at a fixed rate and counts deadline misses (a tick whose observation ->
  action time exceeds the period; the chunk ticks are the expensive ones).
* Every episode starts by restoring the capsule taken at start-up: the policy state (queue,
  step counter, noise stream) is exactly the initial one, with no rebuild.
* What-if: at a chunk boundary the policy forks N branches from its current state (one noise
  seed each), rolls each forward in a copy of the simulator, keeps the best by a score, and
  the live policy continues on the winning seed: the real rollout then replays the winner.

Without --policy it writes the tiny SmolVLA checkpoint (random weights: actions are
meaningless; the point is timing and state). Real-shape timings: bench/policy.py.
"""
from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

import flashrt


class ReachEnv:
    """Joints q (state_dim) chase a target with their first action_dim entries; reward is
    minus the distance. Cameras render the target and the arm as blobs (float images in [0, 1])."""

    def __init__(self, cameras: dict, state_dim: int, action_dim: int, task: str):
        self.cameras, self.state_dim, self.action_dim, self.task = cameras, state_dim, action_dim, task
        self.q = self.target = None

    def reset(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.q = 0.3 * torch.randn(self.state_dim, generator=g)
        self.target = torch.rand(self.action_dim, generator=g) * 2 - 1
        return self.observe(), {}

    def step(self, action: torch.Tensor):
        self.q[: self.action_dim] += 0.05 * torch.tanh(action.float())
        reward = -float(torch.linalg.vector_norm(self.q[: self.action_dim] - self.target))
        return self.observe(), reward, False, False, {}

    def clone(self) -> "ReachEnv":
        return copy.deepcopy(self)

    def _blob(self, shape, xy) -> torch.Tensor:
        _, h, w = shape
        ys, xs = torch.linspace(-1, 1, h)[:, None], torch.linspace(-1, 1, w)[None, :]
        return torch.exp(-((xs - xy[0]) ** 2 + (ys - xy[1]) ** 2) / 0.1)

    def observe(self) -> dict:
        obs = {}
        for key, shape in self.cameras.items():
            img = torch.zeros(shape)
            img[0] = self._blob(shape, self.target[:2].tolist())
            img[1] = self._blob(shape, torch.tanh(self.q[:2]).tolist())
            obs[key] = img.clamp(0, 1)
        return dict(obs, **{"observation.state": self.q.clone(), "task": self.task})


def rollout(policy, env: ReachEnv, obs: dict, n: int) -> tuple[float, dict]:
    """n control steps without timing; (summed reward, last observation)."""
    total = 0.0
    for _ in range(n):
        obs, r, *_ = env.step(policy.select_action(obs))
        total += r
    return total, obs


def what_if(policy, env: ReachEnv, obs: dict, seeds, horizon: int) -> dict:
    """Fork one branch per seed from the live state, roll each `horizon` steps in a copy of
    the simulator, score by summed reward; the live policy takes the winner's seed."""
    cap = policy.snapshot()
    t0 = time.perf_counter()
    scores = {}
    for s in seeds:
        branch = policy.fork(cap, seed=s)
        scores[s] = rollout(branch, env.clone(), obs, horizon)[0]
    best = max(scores, key=scores.get)
    policy.restore(cap)
    policy.seed(best)
    return {"scores": scores, "best": best, "ms": 1e3 * (time.perf_counter() - t0)}


def episode(policy, env: ReachEnv, seed: int, steps: int, hz: float, whatif_at: int,
            branches: int, horizon: int) -> dict:
    period, misses, lat, total, plan = 1.0 / hz, 0, [], 0.0, None
    obs, _ = env.reset(seed)
    deadline = time.perf_counter() + period
    real_from = None
    for t in range(steps):
        if t == whatif_at and branches > 0:
            plan = what_if(policy, env, obs, [1000 * seed + i for i in range(branches)], horizon)
            real_from, plan["real"] = t, 0.0
            deadline = time.perf_counter() + period   # planning pauses the loop; re-anchor
        t0 = time.perf_counter()
        action = policy.select_action(obs)
        lat.append(time.perf_counter() - t0)
        obs, r, *_ = env.step(action)
        total += r
        if real_from is not None and t < real_from + horizon:
            plan["real"] += r
        now = time.perf_counter()
        if now > deadline:
            misses += 1
            deadline = now + period                   # no catch-up burst after a miss
        else:
            time.sleep(deadline - now)
            deadline += period
    lat_ms = sorted(1e3 * x for x in lat)
    return {"seed": seed, "steps": steps, "misses": misses, "score": total, "whatif": plan,
            "median_ms": lat_ms[len(lat_ms) // 2], "max_ms": lat_ms[-1]}


def tiny_policy_dir(out: Path, args) -> Path:
    from flashrt.models import make_checkpoint
    d = make_checkpoint("smolvla", "tiny", out, seed=0)
    cfg = json.loads((d / "config.json").read_text())     # LeRobot allows n_action_steps < chunk_size
    cfg.update(n_action_steps=args.n_action_steps, chunk_size=args.chunk_size, num_steps=args.denoise_steps)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", help="LeRobot SmolVLA directory (default: write the tiny one)")
    ap.add_argument("--hz", type=float, default=10.0)
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30, help="control steps per episode")
    ap.add_argument("--n-action-steps", type=int, default=10, help="for the tiny checkpoint")
    ap.add_argument("--chunk-size", type=int, default=50, help="for the tiny checkpoint")
    ap.add_argument("--denoise-steps", type=int, default=10, help="for the tiny checkpoint")
    ap.add_argument("--branches", type=int, default=3, help="what-if forks (0: none)")
    ap.add_argument("--horizon", type=int, default=10, help="what-if rollout steps")
    ap.add_argument("--whatif-at", type=int, default=10, help="control step of the what-if")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.policy) if args.policy else tiny_policy_dir(Path(tmp) / "smolvla", args)
        info = path / "flashrt_checkpoint.json"
        if not info.exists() or json.loads(info.read_text()).get("random_weights"):
            print("NOTE: random weights: the actions are meaningless; the point is timing and state.")
        policy = flashrt.load_policy(path, device="cpu", dtype="float32", seed=0)
    c = policy.net.config
    env = ReachEnv(dict(c.cameras), c.state_dim, c.action_dim, "reach the red target")
    start = policy.snapshot()                 # every episode begins from exactly this state
    print(f"SmolVLA chunk {c.chunk_size} x {c.num_steps} steps, a chunk every {c.n_action_steps} "
          f"actions; {args.hz:g} Hz, {torch.get_num_threads()} threads")
    eps = []
    for e in range(args.episodes):
        t0 = time.perf_counter()
        policy.restore(start)
        reset_ms = 1e3 * (time.perf_counter() - t0)
        r = episode(policy, env, e, args.steps, args.hz, args.whatif_at, args.branches, args.horizon)
        r["reset_ms"] = reset_ms
        eps.append(r)
        line = (f"episode {e}: reset by restore {reset_ms:.2f} ms; {r['steps']} steps, "
                f"{r['misses']} deadline misses (period {1e3 / args.hz:.0f} ms; obs->action median "
                f"{r['median_ms']:.1f} ms, max {r['max_ms']:.1f} ms); score {r['score']:.3f}")
        print(line)
        w = r["whatif"]
        if w:
            sc = ", ".join(f"seed {s}: {v:.4f}" for s, v in w["scores"].items())
            print(f"  what-if at step {args.whatif_at}: {len(w['scores'])} forks x {args.horizon} "
                  f"steps in {w['ms']:.0f} ms [{sc}] -> seed {w['best']}; real rollout "
                  f"{w['real']:.4f} ({'replays the winner' if w['real'] == w['scores'][w['best']] else 'DIFFERS'})")
    return {"episodes": eps}


if __name__ == "__main__":
    main()
