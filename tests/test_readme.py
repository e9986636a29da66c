"""The README's API tour runs as printed: its first two Python blocks, on a random-weight
checkpoint, with only the inputs it leaves to the reader defined (`ids`, `history_tokens`,
`image_features`, `instruction_ids`)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    text = README.read_text()
    tour = text[text.index("## API tour"):text.index("## Exactness contract")]
    return re.findall(r"```python\n(.*?)```", tour, re.S)


def test_api_tour_runs_unchanged(tmp_path, monkeypatch):
    blocks = _blocks()
    assert len(blocks) >= 2 and "flashrt.load(" in blocks[0] and "set_context" in blocks[1]
    monkeypatch.chdir(tmp_path)                      # save_capsule("turn1.capsule") writes here
    g = torch.Generator().manual_seed(0)
    env = {"ids": torch.randint(0, 200, (128,), generator=g).tolist()}
    exec(compile(blocks[0], "README.md (API tour)", "exec"), env)
    rt = env["rt"]
    env.update(history_tokens=env["ids"] + [5, 6, 7], instruction_ids=[11, 12, 13],
               image_features=torch.randn(4, rt.net.config.hidden_size, generator=g))
    exec(compile(blocks[1], "README.md (reuse)", "exec"), env)
    assert env["cap"].position > 0 and len(env["toks"]) > 0
    assert (tmp_path / "turn1.capsule").exists()


def test_public_names_of_the_readme_resolve():
    import importlib
    names = ["flashrt.load", "flashrt.load_policy", "flashrt.Session", "flashrt.LanguageModel",
             "flashrt.save_capsule", "flashrt.load_capsule", "flashrt.Capsule",
             "flashrt.capsules.CapsuleStore", "flashrt.capsules.redis_tier.RedisTier",
             "flashrt.models.make_checkpoint", "flashrt.serve.build", "flashrt.serve.main",
             "flashrt.lm.load", "flashrt.lm.Options", "flashrt.core.capture_check.hazards",
             "flashrt.models.base.StatefulModel"]
    for name in names:
        mod, _, attr = name.rpartition(".")
        assert callable(getattr(importlib.import_module(mod), attr)), name
