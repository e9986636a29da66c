"""The capsule benchmark runs end to end (CI-sized): its script, its identity checks and its JSON.
Timings are not asserted (they belong to bench/, not to tests); exactness is."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, tmp_path, *args, timeout: int = 600) -> tuple:
    """bench/<script>.py --quick, its JSON in tmp_path: (stdout, the JSON's data)."""
    path = tmp_path / f"{script}.json"
    r = subprocess.run([sys.executable, f"bench/{script}.py", "--quick", "--no-progress", "--out", str(path), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return r.stdout, json.loads(path.read_text())["data"]


def test_capsules_bench_quick(tmp_path):
    text, data = run_bench("capsules", tmp_path,
                           "--size", "tiny", "--arch", "qwen3,qwen3_5", "--tmpdir", str(tmp_path))
    assert "flashrt.native._C" in text and "unavailable" not in text   # native paths measured
    results = data["results"]
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
    _, data = run_bench("redis_tier", tmp_path)
    for run in data["runs"]:
        assert set(run["reused"]) == {run["prefix"]}           # every timed turn 2 hit Redis
        assert run["max_dlogit_vs_cold"] < 1e-4


def test_policy_bench_quick(tmp_path):
    """bench/policy.py end to end on the tiny SmolVLA without the LeRobot venv (its column is
    skipped with a note: CI has no LeRobot venv). Timings are not asserted, only recorded."""
    text, d = run_bench("policy", tmp_path, "--lerobot-python", "")
    assert "LeRobot column skipped" in text and "random weights" in text
    for k in ("vision", "prefix", "denoise", "chunk", "control", "reset", "reset_zero", "rebuild"):
        assert d["flashrt"][k]["n"] == 1 and d["flashrt"][k]["median_ms"] > 0, k
    assert d["lerobot"] == {} and d["max_abs_diff"] is None


def test_serve_bench_quick(tmp_path):
    """bench/serve.py end to end on the tiny model (no llama-cpp venv in CI): every turn after
    the first restores exactly the previous turn's end (prompt + delivered reply; one token per
    character in the text checkpoint), the barge-in turn included; the baseline reuses nothing."""
    _, d = run_bench("serve", tmp_path)
    turns = d["runs"]["flashrt"][0]
    assert turns[0]["cached"] == 0 and len(turns) == 5
    for prev, t in zip(turns, turns[1:]):
        assert t["cached"] == prev["prompt_tokens"] + len(prev["reply"]), t["turn"]
    assert len(turns[3]["reply"]) == 4                          # cut off after 4 delivered tokens
    assert all(x["cached"] == 0 for x in d["runs"]["reprefill"][0])


@pytest.mark.parametrize("dtype, weights, tol", [("float32", "float", 1e-5), ("bfloat16", "float", 2 ** -8 + 1e-5),
                                                 ("float32", "int8", 1e-5)])
def test_linear_bench_quick(tmp_path, dtype, weights, tol):
    """bench/linear.py on the tiny checkpoint (the head too): every kernel column timed, the
    small-M kernel within float32 rounding (bf16: one rounding of each output) of a float64
    reference on the model's own weights (int8: on the weights they stand for)."""
    from flashrt import native
    if not native.SMALL_M_LINEAR or (weights == "int8" and not native.SMALL_M_INT8):
        pytest.skip(f"the small-M kernel does not run here: {native.ext_status()}")
    _, data = run_bench("linear", tmp_path, "--rows", "1", "3", "16", "--dtype", dtype, "--weights", weights,
                        "--head", timeout=300)
    from test_models import _onednn_runs_bf16
    kernels = {"small-M", "F.linear"} if weights == "float" else {"small-M", "torch-int8"}
    kernels |= {"onednn"} if weights == "float" and (dtype == "float32" or _onednn_runs_bf16()) else set()
    kernels |= {"widened"} if dtype == "bfloat16" else set()
    assert set(data["stats"]) == {f"{k} M={m}" for k in kernels for m in (1, 3, 16)}
    assert max(data["max_rel_err"].values()) < tol


def test_speculative_bench_quick(tmp_path):
    """bench/speculative.py end to end (the trained default model and tiny): every speculative
    run, MTP drafts and injected oracle / always-wrong drafters, equals plain greedy. It broke
    unnoticed once (a stale constructor call after the Session redesign)."""
    _, data = run_bench("speculative", tmp_path)
    results = data["results"]
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
    text, d = run_bench("asr", tmp_path)
    assert "random weights" in text
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


def test_tts_bench_quick(tmp_path):
    """bench/tts.py end to end on the tiny Pocket TTS checkpoint: the first frame is the same from
    a WAV, stored latents and a voice capsule; the split frame loop is frames(); transformers'
    loop (noise passed in) is its generate and is flashrt's within tolerance; rollback_to_played
    equals regenerating the played frames; capsule sizes add up. Timings recorded, not asserted."""
    pytest.importorskip("transformers")
    text, d = run_bench("tts", tmp_path)
    assert "random weights" in text
    assert d["size"] == "tiny" and not d.get("partial")
    tt = d["ttfa"]
    assert set(tt["stats"]) == {f"{s} {k}" for s in ("flashrt", "transformers") for k in ("wav", "latents")} \
        | {"flashrt capsule", "transformers voice cache"}
    assert all(s["median_ms"] > 0 for s in tt["stats"].values())
    idn = tt["identity"]
    assert idn["same_first_frame_wav_latents_capsule"]
    assert idn["voice_latents_rel_diff"] < 1e-4 and idn["first_frame_rel_diff"] < 1e-4
    assert idn["voice_cache_first_frame_rel_diff"] < 1e-4
    rtf = d["rtf"]
    assert rtf["identity"]["split_equals_frames"] and rtf["flashrt_rtf"] > 0 and rtf["transformers_rtf"] > 0
    assert rtf["identity"]["transformers_loop_vs_generate_max_diff"] < 1e-5
    assert rtf["identity"]["latents_max_diff"] < 1e-3 and rtf["identity"]["pcm_rel_diff"] < 1e-3
    sen = d["sentences"]["stats"]
    assert set(sen) == {"flashrt", "transformers re-prefill", "transformers voice cache"}
    assert all(len(v) == 5 for v in sen.values())
    bi = d["barge_in"]
    assert bi["identity"]["rollback_equals_regenerated"] and bi["identity"]["reprefill_latents_equal"]
    assert bi["identity"]["reprefill_kv_max_diff"] < 1e-4
    assert set(bi["stats"]) == {"rollback_to_played", "re-prefill prompt + played", "regenerate played frames",
                                "transformers re-prefill"}
    cap = d["capsules"]
    assert cap["voice_bytes"] < cap["mid_bytes"] and cap["mid_delta_bytes"] < cap["mid_bytes"]
    assert cap["mid_bytes"] >= sum(cap["mid_by_kind"].values()) > cap["codec_bytes"] > 0


def test_decode_bench_quick(tmp_path):
    """bench/decode.py end to end on the tiny checkpoint: every format and position timed for
    flashrt, transformers in the float formats only, llama.cpp run or skipped with its reason,
    and the int8 quality table on the shipped trained model. Timings are recorded, not asserted."""
    pytest.importorskip("transformers")
    text, d = run_bench("decode", tmp_path)
    assert "random weights" in text and "Acceptance (issue)" in text
    assert [x["format"] for x in d["runs"]] == ["float32", "bfloat16", "int8"]
    for run in d["runs"]:
        assert [int(P) for P in run["rows"]] == d["positions"]
        for row in run["rows"].values():
            assert row["flashrt"]["ms_per_token"] > 0 and row["bytes"] > 0
            assert (row["transformers"] is None) == (run["weights"] == "int8")
            assert (row["llama.cpp"] is None) == bool(run["notes"]["llama.cpp"])
    forms = d["quality"]["forms"]
    assert forms["bfloat16"]["loss_change"] == 0 and forms["bfloat16"]["agree_teacher_forced"] == 1
    assert abs(forms["int8"]["loss_change"]) < 0.05 and forms["int8"]["agree_teacher_forced"] > 0.8
    assert forms["int8"]["fingerprint"] == forms["float32"]["fingerprint"] + "+int8"


def test_voice_bench_quick(tmp_path):
    """bench/voice.py end to end at tiny shapes: 8 turns in both modes, every stage reached; with
    capsules each turn prefilled only its own prompt after exactly what the conversation kept
    (the turn after the barge-in included), the endpoint fork and the preemptive reply used;
    without, every turn re-prefilled and the lookahead waited out; one barge-in during turn 4's
    reply, keeping a cut of it; the model holds the conversation. Where Pipecat and the server's
    packages are installed, the framework run (Pipecat against `flashrt serve`): 8 turns, each
    with its first audio; turn 1 reused nothing, later turns a prefix from the capsule store; one
    barge-in over turn 4's reply, whose cancel kept exactly the heard text's tokens (one byte, one
    token). Without them, its column is absent with the reason. Timings recorded, not asserted."""
    pytest.importorskip("silero_vad")
    text, d = run_bench("voice", tmp_path)
    assert "random weights" in text and "Acceptance (issue)" in text
    assert d["size"] == "tiny" and d["barge_in_turn"] == 4 and len(d["turns"]) == 8
    assert set(d["runs"]) == {"flashrt", "baseline"}
    for mode, runs in d["runs"].items():
        assert len(runs) == 1, mode
        turns = runs[0]["turns"]
        assert [t["turn"] for t in turns] == list(range(1, 9)), mode
        stages = ("vad", "transcript", "prefill", "first_token", "first_sentence", "first_audio")
        for t in turns:
            assert tuple(t["marks"]) == stages and tuple(t["split"]) == stages, mode
            assert t["marks"]["first_audio"] >= t["marks"]["vad"] > 0, (mode, t["turn"])
        contexts = [t["context_tokens"] for t in turns]
        assert contexts == sorted(contexts) and 0.75 * 2048 < contexts[-1] < 1.25 * 2048, (mode, contexts)
    assert all(d["checks"]["flashrt"].values()) and all(d["checks"]["baseline"].values()), d["checks"]
    assert {"each_turn_appended", "after_barge_in_appended", "endpoint_fork",
            "preemptive_reply_dropped_or_kept"} <= set(d["checks"]["flashrt"])
    assert {"each_turn_reprefilled", "lookahead_waited"} <= set(d["checks"]["baseline"])
    fl = d["runs"]["flashrt"][0]["turns"]
    assert all(t["prefill_tokens"] < t["context_tokens"] for t in fl[1:])
    fw = d["framework"]
    if not all(importlib.util.find_spec(m) for m in ("pipecat", "fastapi", "uvicorn", "multipart")):
        assert fw["measured"] is False and "not installed" in fw["why"] and "framework" in text
        return
    assert fw["measured"] is True and fw["why"] is None and all(fw["checks"].values()), fw["checks"]
    (run,) = fw["runs"]
    turns = run["turns"]
    assert [t["turn"] for t in turns] == list(range(1, 9))
    for t in turns:
        assert tuple(t["marks"]) == tuple(fw["stages"]) and None not in t["marks"].values(), t["turn"]
        assert t["context_tokens"] > 0 and t["reply"], t["turn"]
    assert turns[0]["cached_tokens"] == 0 and all(t["cached_tokens"] > 0 for t in turns[1:])
    (barge,) = [b for b in run["barge_in"] if b["turns_reply"]]
    reply4 = turns[3]["reply"]
    assert barge["closed_turn"] == 4 and barge["played_s"] > 0
    assert reply4.startswith(barge["heard"]) and len(barge["heard"]) < len(reply4)
    assert barge["kept_tokens"] == [len(barge["heard"].encode())]


def test_agent_bench_quick(tmp_path):
    """bench/agent.py end to end at the tiny shape, 3 steps over real servers: each forced step made
    one call its tool's schema accepts; each later step reused at least the previous prompt, exactly
    what the client predicts from the capsules the server stored; the plain turn had the same
    prompt and cached tokens; the re-prefill server reused nothing; every masked decode sample
    made its steps under the grammar; llama-cpp run or absent with its reason. The LangGraph cases
    (issue 34; absent with the reason without the agent-clients extra): the store pressure evicted
    a control conversation each round; with RetainingSaver the replay reused the whole prompt,
    as the warm turn on the same tokens did, and the fork everything up to the previous model
    call's prompt; with the plain saver both re-prefilled; the graph's own replay and fork sent
    the timed requests and got the same cached tokens. Timings recorded, not asserted."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("fastapi")
    text, d = run_bench("agent", tmp_path, timeout=900)
    assert "random weights" in text and "Acceptance (issues 33, 34)" in text
    assert d["size"] == "tiny" and d["steps"] == 3 and all(d["checks"].values()), d["checks"]
    cached = lambda x: x["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    steps = d["runs"]["flashrt"][0]
    assert [s["forced"] for s in steps] == [True, True, False]
    assert cached(steps[0]["agent"]) == 0
    for prev, s in zip(steps, steps[1:]):
        assert prev["prompt_ids"] <= cached(s["agent"]) == s["predicted_cached"] < s["prompt_ids"], s["step"]
    for s in steps:
        assert cached(s["plain"]) == cached(s["agent"]) and s["plain"]["usage"]["prompt_tokens"] == s["prompt_ids"]
        assert s["agent"]["finish"] in (("tool_calls",) if s["forced"] else ("stop", "length")), s["step"]
        assert len(s["agent"]["calls"]) == int(s["forced"]), s["step"]
    assert [cached(x) for x in d["runs"]["reprefill"][0]] == [0, 0, 0]
    rows = d["mask"]["rows"]
    assert len(rows) == 3 and all(r["ms_per_step"] > 0 for r in rows.values()) and d["mask"]["all_steps_made"]
    assert (d["runs"]["llama"] == []) == bool(d["notes"]["llama"])
    rs = d["resume"]
    if not all(importlib.util.find_spec(m) for m in ("langgraph", "langchain_openai")):
        assert rs["measured"] is False and "not installed" in rs["why"]
        return
    assert rs["measured"] is True and all(rs["checks"].values()) and "LangGraph replay and fork" in text, rs["checks"]
    assert rs["pressure"] and all(p["cached_before"] >= p["control_prompt"] - 1 and
                                  p["cached_after"] < p["control_prompt"] // 4 for p in rs["pressure"])
    loop = rs["loops"]["retaining"]
    assert len(loop["prompt_tokens"]) == rs["steps"] == 3 and loop["calls"] == rs["loops"]["plain"]["calls"]
    for case, runs in rs["runs"].items():
        assert len(runs) == d["repeats"], case
        for x in runs:
            if case in ("replay (retaining saver)", "warm turn"):
                assert x["cached"] >= x["prompt_tokens"] - 1 and x["prompt_tokens"] == loop["prompt_tokens"][-1]
            elif case == "fork (retaining saver)":
                assert loop["prompt_tokens"][-2] <= x["cached"] < x["prompt_tokens"]
            else:                                           # the plain saver: a full re-prefill
                assert x["cached"] < x["prompt_tokens"] // 4, case
    for case, g in rs["graph"].items():
        assert g["same_request"] and (g["cached"] == rs["runs"][case][0]["cached"]
                                      if "retaining" in case else g["cached"] < g["prompt_tokens"] // 4), case
