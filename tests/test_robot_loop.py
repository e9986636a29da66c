"""examples/robot_loop.py, briefly: a fixed-rate loop over the tiny SmolVLA (random weights)
with episode resets by restore and a what-if fork step whose winner the real rollout replays."""
from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "robot_loop.py"


def test_robot_loop_runs(capsys):
    spec = importlib.util.spec_from_file_location("robot_loop", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--hz", "50", "--episodes", "2", "--steps", "4", "--n-action-steps", "2",
                    "--chunk-size", "4", "--denoise-steps", "2",
                    "--branches", "2", "--horizon", "2", "--whatif-at", "2"])
    text = capsys.readouterr().out
    assert "random weights" in text and "deadline misses" in text
    eps = out["episodes"]
    assert len(eps) == 2
    for e in eps:
        assert 0 <= e["misses"] <= e["steps"] == 4 and e["max_ms"] >= e["median_ms"] > 0
        w = e["whatif"]
        assert len(w["scores"]) == 2 and len(set(w["scores"].values())) == 2   # seeds differ
        assert w["scores"][w["best"]] == max(w["scores"].values())
        assert w["real"] == w["scores"][w["best"]]       # the live policy replays the winner
    assert eps[0]["score"] != eps[1]["score"]            # other start state per episode
