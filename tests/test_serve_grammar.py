"""The grammar state is execution state, through `flashrt serve` (real uvicorn on loopback): n > 1
choices each follow the grammar, a barge-in mid-JSON keeps exactly what was delivered and the
reply goes on from there, session forks / snapshots / rollbacks carry the grammar state, and
--draft-tokens k gives the tokens --draft-tokens 0 gives. Tiny random-weight Qwen3.5 with its
chat template (make_checkpoint(chat=True)): the JSON is valid, its content meaningless.
flashrt/lm/grammar.py's own tests (test_grammar.py) cover the same at the runtime's level."""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("xgrammar")

from serve_util import Server, sse  # noqa: E402
from test_serve_tools import FEW_BLANKS, NOOP, PICK, USER, WEATHER, conforms, valid_call  # noqa: E402

SCHEMA = {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK, "strict": True}}
FORMATS = {"json_schema": {"response_format": SCHEMA},
           "tool_required": {"tools": [WEATHER, NOOP], "tool_choice": "required", "parallel_tool_calls": False}}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
# raw session text: the grammar starts where a turn's prompt ends
HEAD, ASK = "Pick a color, a digit and a flag.\n", "JSON:"


def start(ckpt, *args):
    # one torch thread: the server shares 2 cores with the test process
    return Server(ckpt("qwen3_5", "tiny", chat=True), "--max-sessions", "2", "--max-seq-len", "2048", "--threads", "1",
                  *args)


@pytest.fixture(scope="module")
def plain(ckpt):
    s = start(ckpt)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def spec(ckpt):
    s = start(ckpt, "--draft-tokens", "3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok(ckpt):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(ckpt("qwen3_5", "tiny", chat=True) / "tokenizer.json"))


def post(server, path, body=None) -> dict:
    r = server.post(path, body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(server, **body) -> dict:
    return post(server, "/v1/chat/completions", {"model": server.model, "messages": USER, **body})


def session(server, prompt=HEAD) -> str:
    return post(server, "/v1/sessions", {"prompt": prompt})["id"]


def turn(server, sid, prompt="", **body) -> dict:
    """A session turn (prompt "": continue); choice 0 with the usage."""
    r = post(server, f"/v1/sessions/{sid}/completions", {"prompt": prompt, **body})
    return {**r["choices"][0], "usage": r["usage"]}


def cut(server, path, body, k) -> list:
    """Stream `body`, read k + 2 ids, cancel saying k were delivered; the ids read."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        got = []
        for ev in sse(r.iter_lines()):
            rid, got = ev["id"], got + ev["choices"][0]["token_ids"]
            if len(got) >= k + 2:
                break
        kind = "chat/completions" if "chat" in path else "completions"
        kept = post(server, f"/v1/{kind}/{rid}/cancel", {"delivered_tokens": k})["kept_tokens"]
    assert kept == [k] and len(got) >= k + 2, (kept, got)
    return got


def unnamed(message) -> dict:
    """A message without its call ids (each call gets a fresh random id)."""
    calls = [c["function"] for c in message.get("tool_calls", ())]
    return {**message, "tool_calls": calls}


def check(choice, fmt, tok=None) -> bool:
    """A reply that ended by itself follows its format; False for one cut by max_tokens."""
    if choice["finish_reason"] == "length":
        return False
    if fmt == "tool_required":
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        valid_call({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
        return True
    assert choice["finish_reason"] == "stop", choice
    text = choice["message"]["content"] if "message" in choice else tok.decode(choice["token_ids"])
    conforms(json.loads(text), PICK)
    return True


def test_completion_formats_are_checked(plain):
    """/v1/completions and session turns take response_format as chat does (a schema keyword it
    cannot enforce is a 400 naming the parameter); an empty prompt continues only a session
    that holds something."""
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
    for path, prompt in (("/v1/completions", "x"), (f"/v1/sessions/{session(plain)}/completions", "")):
        r = plain.post(path, {"prompt": prompt, "response_format": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    for path in ("/v1/completions", f"/v1/sessions/{session(plain, None)}/completions"):
        r = plain.post(path, {"prompt": "", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


# ---- n > 1 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_n_choices_each_follow_the_grammar(plain, fmt):
    """n = 2: greedy choices are the same reply; sampled ones each follow the grammar; choice i
    is the n = 1 reply with seed + i (each choice its own session and RNG: the grammar state of
    one never moves another's) and the same seed gives the same replies (checked on the short
    JSON replies: a Qwen3.5 XML call is ~120 byte tokens)."""
    body = dict(FORMATS[fmt], max_tokens=160, logit_bias=FEW_BLANKS, **NO_THINK)
    greedy = chat(plain, n=2, temperature=0, **body)["choices"]
    assert greedy[0]["token_ids"] == greedy[1]["token_ids"]
    assert [unnamed(c["message"]) for c in greedy] == [unnamed(greedy[0]["message"])] * 2
    sampled = chat(plain, n=2, temperature=1.0, seed=11, **body)["choices"]
    assert sampled[0]["token_ids"] != sampled[1]["token_ids"]
    assert sum(check(c, fmt) for c in greedy[:1] + sampled) >= 2, "too few replies ended to check"
    if fmt == "json_schema":
        again = chat(plain, n=2, temperature=1.0, seed=11, **body)["choices"]
        assert [c["token_ids"] for c in again] == [c["token_ids"] for c in sampled]
        alone = chat(plain, temperature=1.0, seed=12, **body)["choices"][0]
        assert alone["token_ids"] == sampled[1]["token_ids"]


# ---- barge-in -------------------------------------------------------------------------------------
def test_chat_barge_in_mid_json_keeps_what_was_delivered(plain, tok, ckpt):
    """A streamed json_schema chat reply cut after k delivered tokens leaves the state of prompt
    + those k tokens: a next request that extends them (token ids, as the template's re-render
    of an earlier reply is not a prefix) reuses all of it and replies, in the format, exactly as
    a fresh prefill (another cache_salt: nothing reused) does."""
    from flashrt.chat.template import ChatTemplate
    body = dict(response_format=SCHEMA, max_tokens=160, temperature=0, logit_bias=FEW_BLANKS)
    first = chat(plain, **body, **NO_THINK)
    got = cut(plain, "/v1/chat/completions", {"model": plain.model, "messages": USER, **body, **NO_THINK}, 6)
    assert got == first["choices"][0]["token_ids"][: len(got)]            # greedy: the same reply
    template = ChatTemplate(ckpt("qwen3_5", "tiny", chat=True))
    text = template.render(USER, template_kwargs=NO_THINK["chat_template_kwargs"])
    P = tok.encode(text, add_special_tokens=False).ids
    assert len(P) == first["usage"]["prompt_tokens"]
    nxt = {"model": plain.model, "prompt": P + got[:6] + tok.encode("\nAgain:", add_special_tokens=False).ids, **body}
    after = post(plain, "/v1/completions", nxt)
    fresh = post(plain, "/v1/completions", {**nxt, "cache_salt": "fresh"})
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P) + 6
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["choices"][0]["token_ids"] == fresh["choices"][0]["token_ids"]
    assert check(after["choices"][0], "json_schema", tok)


def test_session_barge_in_mid_json_then_continue(plain, tok):
    """A session turn under json_schema cut after k delivered tokens, then a turn that appends
    nothing under the same format: it finishes that JSON, token for token the uncut reply (the
    grammar state is where the model state is: prompt + k, none of the undelivered tokens),
    reusing every kept token. A continuation of a complete reply ends at once."""
    body = dict(response_format=SCHEMA, max_tokens=160, temperature=0, logit_bias=FEW_BLANKS)
    whole = turn(plain, session(plain), ASK, **body)
    assert check(whole, "json_schema", tok)
    sid = session(plain)
    got = cut(plain, f"/v1/sessions/{sid}/completions", {"prompt": ASK, **body}, 5)
    rest = turn(plain, sid, **body)
    assert rest["usage"]["prompt_tokens_details"]["cached_tokens"] == rest["usage"]["prompt_tokens"]
    assert got[:5] + rest["token_ids"] == whole["token_ids"] and rest["finish_reason"] == "stop"
    again = turn(plain, sid, **body)                     # the JSON is complete: nothing may follow
    assert again["token_ids"] == [] and again["finish_reason"] == "stop"
    other = turn(plain, sid, response_format={"type": "json_object"}, max_tokens=4, temperature=0,
                 logit_bias=FEW_BLANKS)
    assert tok.decode(other["token_ids"]).lstrip().startswith("{")    # another grammar starts anew


def test_session_fork_snapshot_restore_rollback_carry_the_grammar(plain, tok):
    """Rolled back into a JSON reply, the session continues it under the same format exactly
    as the reply went on; so do a fork and a snapshot of that point, and the snapshot restored
    after the session moved on. Rolled back to before the reply, the grammar is gone."""
    body = dict(response_format=SCHEMA, max_tokens=160, temperature=0, logit_bias=FEW_BLANKS)
    sid = session(plain)
    whole = turn(plain, sid, ASK, **body)
    assert check(whole, "json_schema", tok)
    ids, j = whole["token_ids"], 7
    base = whole["usage"]["prompt_tokens"]
    assert post(plain, f"/v1/sessions/{sid}/rollback", {"position": base + j})["position"] == base + j
    snap = post(plain, f"/v1/sessions/{sid}/snapshot")["snapshot_id"]
    fork = post(plain, f"/v1/sessions/{sid}/fork")["id"]
    assert turn(plain, sid, **body)["token_ids"] == ids[j:]
    assert turn(plain, fork, **body)["token_ids"] == ids[j:]
    post(plain, f"/v1/sessions/{sid}/restore", {"snapshot_id": snap})
    assert turn(plain, sid, **body)["token_ids"] == ids[j:]
    post(plain, f"/v1/sessions/{sid}/rollback", {"position": base})       # the grammar's start
    assert turn(plain, sid, **body)["token_ids"] == ids
    post(plain, f"/v1/sessions/{sid}/rollback", {"position": base - 1})   # before it: none,
    assert check(turn(plain, sid, **body), "json_schema", tok)           # a new JSON from here


# ---- speculative decoding -------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_draft_tokens_give_the_plain_tokens_under_a_grammar(plain, spec, fmt):
    """Greedy under a grammar, --draft-tokens 3 (MTP drafts checked against the masks, rejected
    ones rolled back in the matcher) replies with the tokens of --draft-tokens 0, streamed or
    not, up to a near-tie of the masked logits (README, exactness contract: a batched verify
    step moves logits by ~1e-6; the plain server's logprobs give the gaps). No logit_bias or
    logprobs on the speculative server: it refuses them."""
    body = dict(FORMATS[fmt], max_tokens=48, temperature=0, **NO_THINK)
    want = chat(plain, logprobs=True, top_logprobs=2, **body)["choices"][0]
    gaps = [e["top_logprobs"][0]["logprob"] - e["top_logprobs"][1]["logprob"] for e in want["logprobs"]["content"]]
    n = next((i for i, g in enumerate(gaps) if g <= 1e-3), len(want["token_ids"]))
    got = chat(spec, **body)["choices"][0]
    with httpx.stream("POST", spec.url + "/v1/chat/completions", timeout=60,
                      json={"model": spec.model, "messages": USER, "stream": True, **body}) as r:
        streamed = [t for ev in sse(r.iter_lines()) if ev != "[DONE]" for t in ev["choices"][0]["token_ids"]]
    assert streamed == got["token_ids"] and got["token_ids"][:n] == want["token_ids"][:n]
    if n == len(want["token_ids"]):                                      # no near-tie: all of it
        assert got["token_ids"] == want["token_ids"] and got["finish_reason"] == want["finish_reason"]
    assert n >= 16, "a near-tie too early to compare much"


def test_draft_tokens_barge_in_then_continue(plain, spec):
    """A cut inside a speculative round (the round's undelivered tokens rolled back, grammar
    state included), then a continuation: the plain server's uncut reply."""
    body = dict(response_format=SCHEMA, max_tokens=40, temperature=0)
    want = turn(plain, session(plain), ASK, **body)["token_ids"]
    sid = session(spec)
    got = cut(spec, f"/v1/sessions/{sid}/completions", {"prompt": ASK, **body}, 6)
    rest = turn(spec, sid, **{**body, "max_tokens": 40 - 6})
    assert got[:6] + rest["token_ids"] == want
