"""SmolVLA policy: chunk inference by stage, control rate, episode reset; flashrt vs LeRobot.

Both sides load the same LeRobot-format directory (random weights, seed 0) and are timed by the
same harness (bench/common.py `measure`) at the same thread count. LeRobot runs in its own venv
(see bench/lerobot_reference.py for its recipe) as a worker process of this script; when that
venv is absent its column is skipped with a note.

    python bench/policy.py                 # the released SmolVLA-base shape (needs a quiet machine)
    python bench/policy.py --size small    # or --quick (tiny, 1 repeat): proves the script runs
    flashrt bench policy --size small

Stages: vision (SigLIP + connector, all cameras); prefix (vision + the VLM layers writing K/V;
LeRobot's embed_prefix embeds the images itself, so both sides time the two together);
denoise (num_steps Euler steps of the action expert over that K/V); chunk (raw observation ->
preprocessor -> policy -> postprocessor). Control rate: n_action_steps select_action calls from
an empty queue (one chunk, the rest from the queue). Reset: flashrt restores the start capsule
(or zeroes with reset(), or builds a new policy state); LeRobot's reset() empties its queue.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

LEROBOT_PY = Path("/work/lerobot-venv/bin/python")
TASK = "pick up the red cube and place it in the box"
STAGES = ("vision", "prefix", "denoise", "chunk", "control", "reset")


def parse(argv):
    p = C.base_parser("bench/policy.py", "SmolVLA chunk inference, control rate and reset")
    p.add_argument("--size", default=None, help="real (default) | small | tiny (--quick: tiny)")
    p.add_argument("--lerobot-python", default=str(LEROBOT_PY),
                   help="python of a LeRobot venv ('' or missing: skip the LeRobot column)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)    # inside LeRobot's venv
    p.add_argument("--inputs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help="policy directory (default: a cached random one)")
    a = p.parse_args(argv)
    a.threads = a.threads or 2
    a.size = a.size or ("tiny" if a.quick else "real")
    a.repeats = a.repeats or (1 if a.quick else 5)
    a.warmup = a.warmup if a.warmup is not None else (0 if a.quick else 1)
    if a.worker:                  # LeRobot's venv: no flashrt import, CPU only
        a.device = "cpu" if a.device == "auto" else a.device
        a.dtype = a.dtype or "float32"
        import torch
        torch.set_num_threads(a.threads)
        return a
    C.setup(a)
    return a


def policy_dir(size: str) -> Path:
    """The cached seed-0 random-weight SmolVLA directory (~/.cache/flashrt/checkpoints)."""
    from flashrt.models import make_checkpoint
    d = Path.home() / ".cache" / "flashrt" / "checkpoints" / f"smolvla-{size}-seed0"
    if not (d / "flashrt_checkpoint.json").exists():
        print(f"making random-weight SmolVLA {size} (once; cached in {d.parent}) ...", flush=True)
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=d.parent))      # same filesystem: the rename is atomic
        make_checkpoint("smolvla", size, tmp / "p", seed=0)
        os.replace(tmp / "p", d)
        tmp.rmdir()
    return d


def make_inputs(cfg: dict, path: Path) -> None:
    """Observation + noise both sides read (seeded), written where the worker can load it."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    t = {k: torch.rand(v["shape"], generator=g) for k, v in cfg["input_features"].items()
         if v["type"] == "VISUAL"}
    t["observation.state"] = torch.randn(cfg["input_features"]["observation.state"]["shape"], generator=g)
    t["noise"] = torch.randn(cfg["chunk_size"], cfg["max_action_dim"], generator=g)
    save_file(t, str(path))


def read_inputs(path):
    from safetensors.torch import load_file
    t = load_file(str(path))
    noise = t.pop("noise")
    return dict(t, task=TASK), noise


# ---- flashrt ---------------------------------------------------------------------------------
def flashrt_cases(a, ckpt: Path, obs: dict, noise) -> tuple[dict, dict]:
    import torch

    import flashrt
    from flashrt.policy import Policy
    pol = flashrt.load_policy(ckpt, device=a.device, dtype=a.dtype)
    net, proc, arena, n = pol.net, pol.processor, pol.arena, pol.net.config.n_action_steps
    inp = proc.preprocess(obs)
    start = pol.snapshot()
    fp = {k: v for k, v in pol.fingerprint.items() if k != "layout"}
    nograd = lambda f: torch.no_grad()(f)  # noqa: E731
    dev_noise = noise.to(pol.device, torch.float32)     # as Policy does for predict_action_chunk

    def control():
        pol.restore(start)
        return [pol.select_action(obs) for _ in range(n)]
    cases = {
        "vision": C.Case(nograd(lambda: net.embed_images(inp["pixels"]))),
        "prefix": C.Case(nograd(lambda: net.fill_prefix(net.embed_images(inp["pixels"]), inp["tokens"],
                                                        inp["token_mask"], inp["state"], arena))),
        "denoise": C.Case(nograd(lambda: net.denoise(dev_noise, arena))),
        "chunk": C.Case(lambda: pol.predict_action_chunk(obs, noise)),
        "control": C.Case(control),
        "reset": C.Case(lambda: pol.restore(start), inner=20),
        "reset_zero": C.Case(pol.reset, inner=20),
        "rebuild": C.Case(lambda: Policy(net, fingerprint=fp, processor=proc)),
    }
    extra = {"state_bytes": start.nbytes, "chunk_out": pol.predict_action_chunk(obs, noise),
             "n_action_steps": n, "layout": {"prefix_rows": net.prefix_len}}
    return cases, extra


# ---- LeRobot (worker, inside its venv) --------------------------------------------------------
def lerobot_cases(a, ckpt: Path, obs: dict, noise) -> tuple[dict, dict]:
    import torch
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy, make_att_2d_masks
    os.chdir(ckpt)          # config.json names the VLM directory relatively
    policy = SmolVLAPolicy.from_pretrained(str(ckpt)).to(C.torch_dtype(a.dtype)).eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(ckpt))
    m, cfg, n = policy.model, policy.config, policy.config.n_action_steps
    batch = pre(dict(obs))
    images, img_masks = policy.prepare_images(dict(batch))
    state = policy.prepare_state(batch)
    tok, tmask = batch["observation.language.tokens"], batch["observation.language.attention_mask"]
    noise = noise[None]

    @torch.no_grad()
    def prefix():
        embs, pad, att = m.embed_prefix(images, img_masks, tok, tmask, state=state)
        _, kv = m.vlm_with_expert.forward(attention_mask=make_att_2d_masks(pad, att),
                                          position_ids=torch.cumsum(pad, dim=1) - 1, past_key_values=None,
                                          inputs_embeds=[embs, None], use_cache=cfg.use_cache,
                                          fill_kv_cache=True)
        return pad, kv
    pad, kv = prefix()

    @torch.no_grad()
    def denoise():
        x, dt = noise.clone(), -1.0 / cfg.num_steps
        for s in range(cfg.num_steps):
            t = torch.tensor(1.0 + s * dt, dtype=torch.float32).expand(1)
            x = x + dt * m.denoise_step(x_t=x, prefix_pad_masks=pad, past_key_values=kv, timestep=t)
        return x

    @torch.no_grad()
    def chunk():
        return post(policy.predict_action_chunk(pre(dict(obs)), noise=noise.clone()))

    @torch.no_grad()
    def control():
        policy.reset()
        return [post(policy.select_action(pre(dict(obs)))) for _ in range(n)]
    cases = {
        "vision": C.Case(torch.no_grad()(lambda: [m.vlm_with_expert.embed_image(i) for i in images])),
        "prefix": C.Case(prefix), "denoise": C.Case(denoise), "chunk": C.Case(chunk),
        "control": C.Case(control), "reset": C.Case(policy.reset, inner=20)}
    return cases, {"chunk_out": chunk()[0], "n_action_steps": n}


def worker(a) -> int:
    """Inside LeRobot's venv: time its cases, write {stage: samples} and its chunk."""
    import torch
    from safetensors.torch import save_file
    obs, noise = read_inputs(a.inputs)
    cases, extra = lerobot_cases(a, Path(a.ckpt), obs, noise)
    stats = C.measure(cases, a.repeats, a.warmup, "cpu")
    save_file({"chunk": extra["chunk_out"].float().contiguous()}, a.out + ".chunk.safetensors")
    import lerobot
    Path(a.out).write_text(json.dumps({"stats": {k: s.samples for k, s in stats.items()},
                                       "versions": {"lerobot": lerobot.__version__,
                                                    "torch": torch.__version__},
                                       "threads": torch.get_num_threads()}))
    return 0


def run_lerobot(a, ckpt: Path, inputs: Path, tmp: Path):
    py = Path(a.lerobot_python) if a.lerobot_python else None
    if py is None or not py.exists():
        return None, f"LeRobot column skipped: no LeRobot venv python at {a.lerobot_python!r}"
    out = tmp / "lerobot.json"
    cmd = [str(py), str(Path(__file__).resolve()), "--worker", "lerobot", "--ckpt", str(ckpt),
           "--inputs", str(inputs), "--out", str(out), "--threads", str(a.threads),
           "--dtype", a.dtype, "--repeats", str(a.repeats), "--warmup", str(a.warmup), "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(C.ROOT))
    if r.returncode != 0:
        return None, f"LeRobot column failed (exit {r.returncode}): {r.stderr.strip()[-400:]}"
    res = json.loads(out.read_text())
    from safetensors.torch import load_file
    res["chunk"] = load_file(str(out) + ".chunk.safetensors")["chunk"]
    res["stats"] = {k: C.Stats(v) for k, v in res["stats"].items()}
    return res, None


# ---- report ----------------------------------------------------------------------------------
def plot(fl: dict, lr: dict | None, path: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = ["vision", "prefix", "denoise", "chunk"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    w = 0.38
    xs = range(len(names))
    ax.bar([x - w / 2 for x in xs], [fl[k].median * 1e3 for k in names], w, label="flashrt")
    if lr:
        ax.bar([x + w / 2 for x in xs], [lr[k].median * 1e3 for k in names], w, label="LeRobot")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("ms (median)")
    ax.set_title("SmolVLA chunk inference by stage (random weights)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(a)
    import torch
    info = C.banner("policy", a)
    ckpt = Path(a.ckpt) if a.ckpt else policy_dir(a.size)
    cfg = json.loads((ckpt / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "inputs.safetensors"
        make_inputs(cfg, inputs)
        obs, noise = read_inputs(inputs)
        lr, note = run_lerobot(a, ckpt, inputs, Path(tmp)) if a.device == "cpu" else \
            (None, "LeRobot column: CPU only here")
        cases, extra = flashrt_cases(a, ckpt, obs, noise)
        fl = C.measure(cases, a.repeats, a.warmup, a.device, desc="flashrt")
    n = extra["n_action_steps"]
    L = lr["stats"] if lr else {}
    title = (f"SmolVLA {a.size} ({a.device}, {a.dtype}, {a.threads} threads): chunk of "
             f"{cfg['chunk_size']} x {cfg['num_steps']} steps, {len(obs) - 2} cameras")
    t = C.Table(title, ["stage", "flashrt ms", "LeRobot ms", "speed-up (>1: flashrt faster)"])
    labels = {"vision": "vision tower + connector", "prefix": "prefix (vision + VLM K/V)",
              "denoise": f"denoising ({cfg['num_steps']} Euler steps)",
              "chunk": "chunk end to end (pre -> policy -> post)"}
    for k, lab in labels.items():
        t.add(lab, fl[k].ms(), L[k].ms() if k in L else "-", C.fmt_ratio(C.ratio(L.get(k), fl[k])))
    hz = lambda s: n / s.median  # noqa: E731
    t.add(f"control rate, {n} select_action from empty queue (Hz)", f"{hz(fl['control']):.1f}",
          f"{hz(L['control']):.1f}" if "control" in L else "-",
          C.fmt_ratio(C.ratio(L.get("control"), fl["control"])))
    t.add("episode reset: restore start capsule", fl["reset"].ms(3), "-", "-")
    t.add("episode reset: reset() (zero the state)", fl["reset_zero"].ms(3),
          L["reset"].ms(3) if "reset" in L else "-", "-")
    t.add("episode reset: rebuild the policy state", fl["rebuild"].ms(3), "-",
          "restore " + C.fmt_ratio(C.ratio(fl["rebuild"], fl["reset"])) + " faster")
    diff = float((extra["chunk_out"] - lr["chunk"]).abs().max()) if lr else None
    t.notes += [f"capsule {C.fmt_bytes(extra['state_bytes'])}; LeRobot's reset() only empties "
                "its queue (its K/V cache is rebuilt every chunk)",
                "speed-up: LeRobot ms / flashrt ms; control rate: flashrt Hz / LeRobot Hz",
                "flashrt and LeRobot run one after the other in this run (LeRobot first, in its "
                "own process); a loaded machine makes both noisy"]
    if note:
        t.notes.append(note)
    if diff is not None:
        t.notes.append(f"same weights, observation and noise: max |flashrt - LeRobot| chunk = {diff:.2e}")
        t.notes.append(f"LeRobot {lr['versions']['lerobot']}, torch {lr['versions']['torch']}, "
                       f"{lr['threads']} threads")
    C.print_tables([t])
    name = "policy" if a.size == "real" else f"policy-{a.size}"
    png = plot(fl, L or None, C.result_path(name, a).with_suffix(".png"))
    if png:
        print(f"plot: {png}")
    data = {"size": a.size, "flashrt": fl, "lerobot": L, "lerobot_note": note,
            "max_abs_diff": diff, "n_action_steps": n, "state_bytes": extra["state_bytes"],
            "torch_threads": torch.get_num_threads()}
    C.write_json(name, a, info, [t], data, argv, script="policy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
