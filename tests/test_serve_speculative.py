"""flashrt serve --draft-tokens: speculative decoding with the checkpoint's MTP layer behind the
same API. The shipped default model (trained here; its MTP drafts are accepted often) makes
rounds of several tokens, so stops, budgets and barge-in land inside rounds. Real uvicorn on
loopback with the openai client, and the engine in-process for the state it leaves."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serve_util import Reference, Server  # noqa: E402

import flashrt  # noqa: E402
from flashrt.assets import trained_model_path  # noqa: E402
from flashrt.core.step import StepCtx  # noqa: E402

DRAFTS = 3


@pytest.fixture(scope="module")
def model():
    return trained_model_path()


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(model, "--max-sessions", "2", "--draft-tokens", str(DRAFTS),
               log=tmp_path_factory.mktemp("spec") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref(model):
    return Reference(model)


def _prompt(ref, text):
    return ref.rt.tokenizer.encode(text)


CODE = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("


def test_greedy_streaming_and_reuse_follow_plain_greedy(server, ref):
    P = _prompt(ref, CODE)
    a = server.complete(P, max_tokens=40)
    gen = a["choices"][0]["token_ids"]
    assert len(gen) == 40 and ref.check(P, gen) >= 20
    body = {"model": server.model, "prompt": P, "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        streamed = [t for line in r.iter_lines() if line.startswith("data: {")
                    for t in json.loads(line[6:])["choices"][0]["token_ids"]]
    assert streamed == gen
    U = _prompt(ref, "\n    return 0\n")
    b = server.complete(P + gen + U, max_tokens=24)          # turn 2 from the turn-end capsule
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P) + len(gen)
    assert ref.check(P + gen + U, b["choices"][0]["token_ids"]) >= 1


def test_budgets_and_stop_strings_inside_rounds(server, ref):
    P = _prompt(ref, CODE)
    full = server.complete(P, max_tokens=40)["choices"][0]
    for n in (1, 2, 5, 7):                                  # budgets that cut rounds short
        got = server.complete(P, max_tokens=n)["choices"][0]["token_ids"]
        assert got == full["token_ids"][:n]
    text = full["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    body = {"model": server.model, "prompt": P, "max_tokens": 40, "temperature": 0, "stop": [stop]}
    out = server.post("/v1/completions", body).json()["choices"][0]
    assert out["text"] == text[: text.find(stop)] and out["finish_reason"] == "stop"
    # the conversation holds what was sent, not the round's tokens past the stop string
    nxt = server.complete(P + out["token_ids"], max_tokens=4)
    assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P) + len(out["token_ids"])


def test_barge_in_keeps_what_was_delivered(server, ref):
    P = _prompt(ref, "class Config:\n    def __init__(self, path):\n        self.")
    body = {"model": server.model, "prompt": P, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        got, rid = [], None
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                rid, got = ev["id"], got + ev["choices"][0]["token_ids"]
                if len(got) >= 6:
                    break
        k = len(got) - 2                                     # the client spoke fewer than it read
        reply = server.post(f"/v1/completions/{rid}/cancel", {"delivered_tokens": k}).json()
    kept = reply["kept_tokens"]
    assert (kept if isinstance(kept, int) else kept[0]) == k
    U = _prompt(ref, "name")
    nxt = server.complete(P + got[:k] + U, max_tokens=8)
    assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P) + k
    assert ref.check(P + got[:k] + U, nxt["choices"][0]["token_ids"]) >= 1


def test_sampled_choices_reproducible(server, ref):
    c = server.client()
    kw = dict(model=server.model, prompt=_prompt(ref, CODE), max_tokens=24, temperature=0.8, seed=5)
    r = c.completions.create(n=2, **kw)
    outs = [ch.model_extra["token_ids"] for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert all(len(o) == 24 for o in outs) and outs[0] != outs[1]
    again = c.completions.create(n=2, **kw)
    assert [ch.model_extra["token_ids"] for ch in sorted(again.choices, key=lambda ch: ch.index)] == outs


def test_engine_turn_speculates_and_leaves_draft_rows_valid(model):
    """In-process: a turn decodes in rounds that accept drafts, and the session it leaves (the
    one its turn-end capsule copies) holds the draft head's rows [0, P-1) and hidden as a
    one-shot MTP pass over its history writes them, so the next turn drafts from them."""
    from flashrt.serve.engine import Choice, Engine, Job
    from flashrt.serve.events import FINAL, Done, Finished
    from flashrt.serve.options import ServeOptions
    from flashrt.serve.text import TextStream
    options = ServeOptions.from_settings(dtype="float32", max_seq_len=512, max_sessions=1,
                                         capsule_budget_mb=64, draft_tokens=DRAFTS)
    eng = Engine(options, model_dir=model)
    try:
        rt = eng.models[0]
        events, done = [], threading.Event()

        def post(ev):
            events.append(ev)
            if isinstance(ev, FINAL):
                done.set()
        P = rt.tokenizer.encode(CODE)
        job = Job("cmpl-1", P, 1, 32, 0.0, 1.0, None, [], post, ignore_eos=True)
        job.choices = [Choice(0, TextStream(eng.tokenizer, []), 0)]
        eng.submit(job)
        assert done.wait(60) and isinstance(events[-1], Done), events[-1]
        st = rt.speculation().stats
        assert st["accepted"] > 0 and st["rounds"] < 32
        toks = rt.tokens
        assert toks[: len(P)] == P and len(toks) == len(P) + 32
        fresh = flashrt.load(model, dtype="float32", max_seq_len=512)
        net, n = fresh.net, len(toks)
        with torch.no_grad():
            ids = torch.tensor(toks)
            hid = net.hidden(net.embed(ids), StepCtx(n, torch.arange(n), start=0), fresh.arena, True)
            net.draft(ids[1:], hid[:-1], StepCtx(n - 1, torch.arange(n - 1), start=0), fresh.arena)
        for name in ("mtp.attn.k", "mtp.attn.v"):
            d = (rt.arena[name][: n - 1] - fresh.arena[name][: n - 1]).abs().max()
            assert d <= 1e-4, f"{name} rows [0, {n - 1}) differ by {d:.3g}"
        assert (rt.arena["mtp.hidden"] - hid[-1]).abs().max() <= 1e-4
        # stop strings ending at many points of that text, most inside a round: the session
        # keeps exactly the prompt and the ids the client got, not the round's tokens past them
        text = eng.tokenizer.decode(toks[len(P):])
        cuts = [c for c in range(4, len(text) - 2, 3) if text.find(text[c:c + 2]) == c][:12]
        assert len(cuts) >= 6, text
        for i, c in enumerate(cuts):
            events.clear()
            done.clear()
            job = Job(f"cmpl-s{i}", P, 1, 32, 0.0, 1.0, None, [text[c:c + 2]], post, ignore_eos=True)
            job.choices = [Choice(0, TextStream(eng.tokenizer, job.stops), 0)]
            eng.submit(job)
            assert done.wait(60) and isinstance(events[-1], Done), events[-1]
            fin = next(e for e in events if isinstance(e, Finished))
            assert fin.reason == "stop" and rt.tokens == P + list(fin.token_ids), (c, fin)
    finally:
        eng.close()


def test_draft_tokens_refused_without_a_draft_head(ckpt):
    from flashrt.serve.server import build
    with pytest.raises(ValueError, match="no draft head"):
        build(ckpt("qwen3", "tiny"), dtype="float32", max_seq_len=64, max_sessions=1, draft_tokens=2)
    with pytest.raises(ValueError, match="--draft-tokens must be >= 0"):
        build(ckpt("qwen3_5", "tiny"), draft_tokens=-1)
