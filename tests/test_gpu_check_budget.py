"""bench/gpu_check.sh fits one device call by its own arithmetic: the declared step caps, with one
kill grace and one publish per step and the final reserve, add up within BUDGET_S (<= 420 s, the
build included) and stage 1 (build, extension check, CUDA tests) within STAGE1_S (<= 180 s).
The caps are parsed from the script's text, and cross-checked against the table the script itself
records in --plan mode, which also shows every step is recorded and the results reach $OUT."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.sh"
STEP = re.compile(r'^step (\d) (\d+) "([^"]+)"', re.M)


def _text() -> str:
    return SCRIPT.read_text()


def _const(name: str) -> int:
    m = re.search(rf"^{name}=(\d+)\b", _text(), re.M)
    assert m, f"{name}= not declared in {SCRIPT.name}"
    return int(m.group(1))


def _declared():
    return [(int(s), int(c), n) for s, c, n in STEP.findall(_text())]


def test_caps_sum_within_budget():
    steps = _declared()
    budget, stage1, reserve = _const("BUDGET_S"), _const("STAGE1_S"), _const("RESERVE_S")
    per_step = _const("KILL_S") + _const("PUBLISH_S")
    assert budget <= 420 and stage1 <= 180
    one = [c for s, c, _ in steps if s == 1]
    assert one and len(one) < len(steps), "both stages need steps"
    assert sum(one) + per_step * len(one) <= stage1, f"stage 1: {sum(one)} s of caps"
    total = sum(c for _, c, _ in steps) + per_step * len(steps) + reserve
    assert total <= budget, f"{total} s > budget {budget} s"
    assert [s for s, _, _ in steps] == sorted(s for s, _, _ in steps), "stage 1 steps come first"


def test_every_call_is_declared_and_soft():
    text = _text()
    code = [l for l in text.splitlines() if l.strip() and not l.lstrip().startswith("#")]
    calls = [l for l in code if re.match(r"\s*step \d", l)]
    assert len(calls) == len(_declared()), "a step call the parser does not see (a loop, a variable cap?)"
    assert all(re.match(r"step \d", l) for l in calls), "step calls at top level only (no loops)"
    assert not any(re.match(r"\s*set -[a-z]*e", l) for l in code), "set -e would make steps hard"
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("tar") is None,
                    reason="needs coreutils timeout and tar")
def test_plan_records_every_step(tmp_path):
    out, res = tmp_path / "out", tmp_path / "res"
    out.mkdir()
    proc = subprocess.run(["bash", str(SCRIPT), "--plan", "--results", str(res)], env={"OUT": str(out),
                          "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((res / "gpu_check-summary.json").read_text())
    got = [(s["stage"], s["cap_s"], s["name"]) for s in summary["steps"]]
    assert got == _declared()
    assert all(s["status"] == "planned" and s["timeout_s"] == s["cap_s"] for s in summary["steps"])
    assert summary["budget_s"] == _const("BUDGET_S")
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check-results.tar.gz", "gpu_check-summary.json",
                                                     "gpu_check.log"]   # <= 8 files come back
