"""LeRobot's own SmolVLA, built at a tiny shape with random weights: writes the golden files
that tests/test_smolvla.py compares flashrt against (preprocessor -> policy -> postprocessor).

Runs ONLY inside a LeRobot venv, never flashrt's. lerobot 0.4.4 pins torch<2.11 and imports
torchvision at import time (lerobot.configs -> optim -> datasets.utils); PyPI's torchvision
wheels are CUDA builds that need libtorch_cuda, so the local CPU torch 2.13.0 cannot serve and
the venv takes PyPI's torch 2.10 (a CUDA build, multi-GB; it runs on CPU). lerobot itself goes
in with --no-deps, then only what its SmolVLA import chain needs, at lerobot's pins:

    python3.11 -m venv /work/lerobot-venv && P=/work/lerobot-venv/bin/pip
    $P install "torch==2.10.*" "torchvision==0.25.*"
    $P install --no-deps "lerobot==0.4.4"
    $P install "transformers==4.57.*" "huggingface-hub>=0.34.2,<0.36" "draccus==0.10.0" \
        "datasets>=4,<5" "diffusers>=0.27.2,<0.36" "accelerate>=1.10,<2" "einops>=0.8,<0.9" \
        "pyserial>=3.5,<4" "deepdiff>=7.0.1,<9" "av>=15,<16" "gymnasium>=1.1.1,<2" \
        "imageio>=2.34,<3" pillow num2words "packaging>=24.2,<26" "setuptools>=71,<81"
    /work/lerobot-venv/bin/python bench/lerobot_reference.py     # -> tests/golden/smolvla_tiny/

What it writes (random weights, seeded; nothing comes from a hub):
- the policy exactly as LeRobot saves it: config.json, model.safetensors (LeRobot's parameter
  names), policy_preprocessor.json / policy_postprocessor.json + their normalizer safetensors,
  and vlm/ (the local SmolVLM directory config.json's vlm_model_name points at, written by
  flashrt/models/smolvla_checkpoint.py: config + a `tokenizers`-built tokenizer);
- golden.safetensors + golden.json: for each case the raw observation (images in [0, 1], state,
  task text), the noise, the preprocessed batch, vision-tower + connector output per camera, the
  prefix embeddings, layer-0 and last-layer prefix K/V, the normalised action chunk, the
  postprocessed chunk, and three successive select_action outputs.
The goldens come from the policy and processors LeRobot reads back from disk (from_pretrained).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil

import torch
from safetensors.torch import save_file

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "golden" / "smolvla_tiny"
TASKS = ("pick up the red cube and place it in the box", "fold the towel")


def _checkpoint_module():
    # loaded by path: the flashrt package (and its models/__init__) is not installed in this venv
    spec = importlib.util.spec_from_file_location("smolvla_checkpoint",
                                                  REPO / "flashrt" / "models" / "smolvla_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_policy(out: pathlib.Path, seed: int):
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    ck = _checkpoint_module()
    layout = ck.policy_layout("tiny")
    ck.write_vlm_dir(out / ck.VLM_DIR, "tiny")
    image = ck.vlm_config("tiny")["vision_config"]["image_size"]
    inputs = {f"observation.images.{cam}": PolicyFeature(FeatureType.VISUAL, tuple(shape))
              for cam, shape in layout["cameras"].items()}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (layout["state_dim"],))
    outputs = {"action": PolicyFeature(FeatureType.ACTION, (layout["action_dim"],))}
    cfg = SmolVLAConfig(input_features=inputs, output_features=outputs, device="cpu",
                        vlm_model_name=ck.VLM_DIR, load_vlm_weights=False,
                        num_vlm_layers=layout["num_vlm_layers"],
                        resize_imgs_with_padding=(image, image))
    torch.manual_seed(seed)
    policy = SmolVLAPolicy(cfg)
    ck.decisive_init(list(policy.named_parameters()), seed)   # the numbers make_checkpoint draws
    pre, post = make_smolvla_pre_post_processors(cfg, dataset_stats=ck.random_stats("tiny", seed))
    policy.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)


def load_policy(out: pathlib.Path):
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    policy = SmolVLAPolicy.from_pretrained(str(out))
    policy.eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(out))
    return policy, pre, post


def _observation(layout: dict, g: torch.Generator, task: str) -> dict:
    obs = {f"observation.images.{cam}": torch.rand(shape, generator=g)
           for cam, shape in layout["cameras"].items()}
    obs["observation.state"] = torch.randn(layout["state_dim"], generator=g)
    obs["task"] = task
    return obs


@torch.no_grad()
def run_case(policy, pre, post, obs: dict, noise: torch.Tensor, tag: str) -> dict:
    out = {f"{tag}.obs.{k}": v for k, v in obs.items() if k != "task"}
    out[f"{tag}.noise"] = noise
    batch = pre(dict(obs))
    for k in ("observation.language.tokens", "observation.language.attention_mask", "observation.state"):
        out[f"{tag}.pre.{k}"] = batch[k].clone()
    # intermediates, through the same LeRobot calls sample_actions makes
    m = policy.model
    images, img_masks = policy.prepare_images(dict(batch))
    for cam_key, img in zip([k for k in policy.config.image_features if k in batch], images):
        out[f"{tag}.pixels.{cam_key}"] = img.clone()
        out[f"{tag}.vision.{cam_key}"] = m.vlm_with_expert.embed_image(img).clone()
    state = policy.prepare_state(batch)
    embs, pad, att = m.embed_prefix(images, img_masks, batch["observation.language.tokens"],
                                    batch["observation.language.attention_mask"], state=state)
    out[f"{tag}.prefix_embs"], out[f"{tag}.prefix_pad"] = embs, pad
    from lerobot.policies.smolvla.modeling_smolvla import make_att_2d_masks
    _, kv = m.vlm_with_expert.forward(attention_mask=make_att_2d_masks(pad, att),
                                      position_ids=torch.cumsum(pad, dim=1) - 1, past_key_values=None,
                                      inputs_embeds=[embs, None], use_cache=True, fill_kv_cache=True)
    for layer in (0, len(kv) - 1):
        out[f"{tag}.prefix_k.{layer}"] = kv[layer]["key_states"].clone()
        out[f"{tag}.prefix_v.{layer}"] = kv[layer]["value_states"].clone()
    # the policy API itself
    policy.reset()
    chunk = policy.predict_action_chunk(dict(batch), noise=noise.clone())
    out[f"{tag}.chunk"] = chunk.clone()
    out[f"{tag}.chunk_post"] = post(chunk.clone()).clone()
    policy.reset()
    for i in range(3):   # the first call runs the chunk, the next two pop the queue
        act = policy.select_action(pre(dict(obs)), noise=noise.clone())
        out[f"{tag}.select.{i}"] = post(act).clone()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = a.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.set_num_threads(2)
    cwd = os.getcwd()
    os.chdir(out)   # config.json names the VLM directory relatively ("vlm"); LeRobot resolves it here
    try:
        build_policy(out, a.seed)
        policy, pre, post = load_policy(out)
        layout = _checkpoint_module().policy_layout("tiny")
        g = torch.Generator().manual_seed(a.seed + 3)
        tensors = {}
        for i, task in enumerate(TASKS):
            obs = _observation(layout, g, task)
            noise = torch.randn(1, policy.config.chunk_size, policy.config.max_action_dim, generator=g)
            tensors.update(run_case(policy, pre, post, obs, noise, f"case{i}"))
    finally:
        os.chdir(cwd)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "golden.safetensors"))
    import lerobot
    import transformers
    meta = {"what": "LeRobot SmolVLA reference outputs, random weights (seed %d)" % a.seed,
            "cases": [{"tag": f"case{i}", "task": t} for i, t in enumerate(TASKS)],
            "versions": {"lerobot": lerobot.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "regenerate": "python bench/lerobot_reference.py  (inside the LeRobot venv)"}
    (out / "golden.json").write_text(json.dumps(meta, indent=2))
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({total / 1e6:.2f} MB), versions {meta['versions']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
