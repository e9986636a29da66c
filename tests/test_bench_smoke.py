"""The capsule benchmark runs end to end (CI-sized): its script, its identity checks and its JSON.
Timings are not asserted (they belong to bench/, not to tests); exactness is."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_capsules_bench_quick(tmp_path):
    out = tmp_path / "capsules.json"
    r = subprocess.run([sys.executable, "bench/capsules.py", "--quick", "--size", "tiny",
                        "--arch", "qwen3,qwen3_5", "--no-progress", "--out", str(out),
                        "--tmpdir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "flashrt.native._C" in r.stdout and "unavailable" not in r.stdout   # native paths measured
    results = json.loads(out.read_text())["data"]["results"]
    assert [x["arch"] for x in results] == ["qwen3", "qwen3_5"]
    for res in results:
        assert res["all_exact"], res["arch"]              # restored / loaded bytes == snapshot's
        for row in res["rows"]:
            assert row["restore_exact"] and row["load_exact"]
            assert row["state_bytes"] == res["fixed_state_bytes"] + row["position"] * res["per_token_bytes"]
            for ratio in (*row["device_ratio"].values(), *row["disk_ratio"].values()):
                assert ratio is not None and ratio > 0


def test_redis_bench_quick(tmp_path):
    """bench/redis_tier.py end to end: node B reuses the whole turn 1 from Redis, cold-equal."""
    out = tmp_path / "redis_tier.json"
    r = subprocess.run([sys.executable, "bench/redis_tier.py", "--quick", "--no-progress", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for run in json.loads(out.read_text())["data"]["runs"]:
        assert set(run["reused"]) == {run["prefix"]}           # every timed turn 2 hit Redis
        assert run["max_dlogit_vs_cold"] < 1e-4


def test_policy_bench_quick(tmp_path):
    """bench/policy.py end to end on the tiny SmolVLA without the LeRobot venv (its column is
    skipped with a note: CI has no LeRobot venv). Timings are not asserted, only recorded."""
    out = tmp_path / "policy.json"
    r = subprocess.run([sys.executable, "bench/policy.py", "--quick", "--no-progress", "--out", str(out),
                        "--lerobot-python", ""], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "LeRobot column skipped" in r.stdout and "random weights" in r.stdout
    d = json.loads(out.read_text())["data"]
    for k in ("vision", "prefix", "denoise", "chunk", "control", "reset", "reset_zero", "rebuild"):
        assert d["flashrt"][k]["n"] == 1 and d["flashrt"][k]["median_ms"] > 0, k
    assert d["lerobot"] == {} and d["max_abs_diff"] is None


def test_serve_bench_quick(tmp_path):
    """bench/serve.py end to end on the tiny model (no llama-cpp venv in CI): every turn after
    the first restores exactly the previous turn's end (prompt + delivered reply; one token per
    character in the text checkpoint), the barge-in turn included; the baseline reuses nothing."""
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, "bench/serve.py", "--quick", "--no-progress", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    d = json.loads(out.read_text())["data"]
    turns = d["runs"]["flashrt"][0]
    assert turns[0]["cached"] == 0 and len(turns) == 5
    for prev, t in zip(turns, turns[1:]):
        assert t["cached"] == prev["prompt_tokens"] + len(prev["reply"]), t["turn"]
    assert len(turns[3]["reply"]) == 4                          # cut off after 4 delivered tokens
    assert all(x["cached"] == 0 for x in d["runs"]["reprefill"][0])


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2 ** -8 + 1e-5)])
def test_linear_bench_quick(tmp_path, dtype, tol):
    """bench/linear.py on the tiny checkpoint: every kernel column timed, the small-M kernel
    within float32 rounding (bf16: one rounding of each output) of a float64 reference on the
    model's own weights."""
    from flashrt import native
    if not native.SMALL_M_LINEAR:
        pytest.skip(f"the small-M kernel does not run here: {native.ext_status()}")
    out = tmp_path / "linear.json"
    r = subprocess.run([sys.executable, "bench/linear.py", "--quick", "--rows", "1", "3", "16",
                        "--dtype", dtype, "--no-progress", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(out.read_text())["data"]
    from test_models import _onednn_runs_bf16
    kernels = {"small-M", "F.linear"}
    kernels |= {"onednn"} if dtype == "float32" or _onednn_runs_bf16() else set()
    kernels |= {"widened"} if dtype == "bfloat16" else set()
    assert set(data["stats"]) == {f"{k} M={m}" for k in kernels for m in (1, 3, 16)}
    assert max(data["max_rel_err"].values()) < tol


def test_speculative_bench_quick(tmp_path):
    """bench/speculative.py end to end (the trained default model and tiny): every speculative
    run, MTP drafts and injected oracle / always-wrong drafters, equals plain greedy. It broke
    unnoticed once (a stale constructor call after the Session redesign)."""
    out = tmp_path / "speculative.json"
    r = subprocess.run([sys.executable, "bench/speculative.py", "--quick", "--no-progress", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads(out.read_text())["data"]["results"]
    assert [x["size"] for x in results] == ["trained", "tiny"]
    for res in results:
        runs = {k: v for k, v in res["end_to_end"].items() if k != "plain"}
        assert runs and all(v["same_as_plain"] for v in runs.values()), res["size"]
        # the oracle never misses, the wrong drafter always does: each mechanism rewound its way
        for k in (1, 2, 3, 4):
            assert runs[f"wrong a=0 k={k} planes"]["stats"]["plane_rewinds"] > 0
            assert runs[f"wrong a=0 k={k} rerun"]["stats"]["reprefills"] > 0
            assert runs[f"wrong a=0 k={k} planes"]["stats"]["reprefills"] == 0


def test_asr_bench_quick(tmp_path):
    """bench/asr.py end to end on the tiny Nemotron checkpoint: transformers' streaming path on
    the same weights gives flashrt's tokens (or parts at a near-tie), its streamed mel chunks are
    its whole-utterance features, the wait arithmetic holds at every chunk phase (checked by
    pushing), the endpoint fork flushes exactly the pending frames and leaves the live stream to
    continue bitwise. Timings are recorded, not asserted."""
    pytest.importorskip("transformers")
    out = tmp_path / "asr.json"
    r = subprocess.run([sys.executable, "bench/asr.py", "--quick", "--no-progress", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "random weights" in r.stdout
    d = json.loads(out.read_text())["data"]
    assert d["size"] == "tiny" and d["lookaheads"] == [0, 6]
    for R, row in d["rtf"].items():
        assert row["flashrt"]["median_ms"] > 0 and row["transformers"]["median_ms"] > 0, R
        idn = row["identity"]
        assert idn["frames"] == row["flashrt_out"]["frames"], R
        assert idn["same_tokens"] or idn["top2_gap_at_diff"] <= max(1e-3, idn["max_logit_diff_before"]), (R, idn)
        assert idn["streamed_mel_max_diff"] <= 1e-5, R
    for R, ep in d["endpoint"].items():
        assert len(ep["phases"]) == int(R) + 1 and ep["all_waits_verified"], R
        for p in ep["phases"]:
            assert p["fork_decoded_frames"] == p["pending_frames"], (R, p["pending_frames"])
        assert ep["wait_R_frames_ms"] >= int(R) * 80
    for R, x in d["next_utterance"].items():
        assert x["fork_continues_bitwise"], R
    cap = d["capsule"]
    assert cap["same_size_everywhere"] and cap["bytes"] >= sum(cap["by_kind"].values()) > 0
