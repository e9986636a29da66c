"""flashrt serve against a real uvicorn server on loopback, with the official openai client and
httpx. Tiny random-weight checkpoints: the text is meaningless; token identity, cached_tokens
and the capsule bookkeeping are what is checked."""
from __future__ import annotations

import concurrent.futures
import json
import random

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serve_util import Reference, Server, sse  # noqa: E402

from flashrt.serve.text import ChatTemplate, TextStream  # noqa: E402
from flashrt.models.tokenizer import ByteTokenizer  # noqa: E402

VOCAB = 512


def rand_ids(n, seed):
    r = random.Random(seed)
    return [r.randrange(VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(ckpt):
    return ckpt("qwen3_5", "tiny")


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = Server(tiny, "--max-sessions", "4", "--max-queue", "16",
               log=tmp_path_factory.mktemp("srv") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref(tiny):
    return Reference(tiny)


# ---- text: detokenization and stop strings (no server) -----------------------------------
def test_text_stream_utf8_and_stops():
    tok = ByteTokenizer(VOCAB)
    text = "héllo wörld €5 STOP never"
    ts, out = TextStream(tok, []), []
    for b in text.encode():
        out.append(ts.feed(b))
    out.append(ts.finish())
    assert "".join(out) == text and not any("\ufffd" in d for d in out)
    ts, out = TextStream(tok, ["STOP", "xyz"]), []
    for b in text.encode():
        d = ts.feed(b)
        out.append(d)
        assert "S" not in d                     # the partial match "S", "ST", ... is held back
        if ts.stopped:
            break
    assert "".join(out) == "héllo wörld €5 " and ts.stopped
    ts = TextStream(tok, ["STOP"])
    assert "".join([ts.feed(b) for b in b"abST"] + [ts.finish()]) == "abST"   # no stop: released
    # delivered_chars -> tokens whose text was wholly delivered: "hé" is 3 bytes
    ts = TextStream(tok, [])
    for b in "héllo".encode():
        ts.feed(b)
    assert [ts.covered(c) for c in (0, 1, 2, 3)] == [0, 1, 3, 4]


# ---- OpenAI endpoints -----------------------------------------------------------------------
def test_chat_and_completions_openai_client(server, ref):
    c, model = server.client(), server.model
    assert [m.id for m in c.models.list().data] == [model]
    r = c.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Hi!"}],
                                  max_tokens=6, temperature=0)
    prompt = ByteTokenizer(VOCAB).encode(ChatTemplate(server_ckpt(server)).render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]))
    assert r.usage.prompt_tokens == len(prompt) and 1 <= r.usage.completion_tokens <= 6
    assert r.choices[0].message.role == "assistant"
    ref.check(prompt, r.choices[0].model_extra["token_ids"])
    ids = rand_ids(20, 1)
    t = c.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert t.usage.prompt_tokens == 20 and t.choices[0].finish_reason in ("length", "stop")
    assert ref.check(ids, t.choices[0].model_extra["token_ids"]) >= 1
    s = c.completions.create(model=model, prompt="plain text prompt", max_tokens=4, temperature=0)
    assert s.usage.prompt_tokens == len(b"plain text prompt")


def server_ckpt(server):
    return server.proc.args[4]


def test_streaming_include_usage_and_token_index(server):
    c, model = server.client(), server.model
    ids = rand_ids(24, 2)
    full = server.complete(ids, max_tokens=12)
    chunks = list(c.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full["choices"][0]["text"]
    idx = [ch.choices[0].model_extra["token_index"] for ch in chunks if ch.choices]
    assert idx == sorted(idx) and idx[-1] == full["usage"]["completion_tokens"] - 1
    got = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]
    assert got == full["choices"][0]["token_ids"]
    assert chunks[-1].usage.completion_tokens == full["usage"]["completion_tokens"]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 24   # the same prompt again
    chat = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"


def test_stop_strings(server):
    ids = rand_ids(16, 3)
    full = server.complete(ids, max_tokens=24)["choices"][0]["text"]
    stop = full[6:9]
    want = full[: full.find(stop)]
    for stream in (False, True):
        body = {"model": server.model, "prompt": ids, "max_tokens": 24, "temperature": 0,
                "stop": [stop], "stream": stream}
        if stream:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                ev = sse(r.iter_lines())
            text = "".join(e["choices"][0]["text"] for e in ev[:-1])
            finish = ev[-2]["choices"][0]["finish_reason"]
        else:
            out = server.post("/v1/completions", body).json()["choices"][0]
            text, finish = out["text"], out["finish_reason"]
        assert text == want and finish == "stop" and stop not in text


def test_cached_tokens_exact_and_greedy_equal_with_reuse(server, ref):
    P = rand_ids(40, 4)
    a = server.complete(P, max_tokens=8)
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    gen = a["choices"][0]["token_ids"]
    ref.check(P, gen)
    U = rand_ids(7, 5)
    b = server.complete(P + gen + U, max_tokens=8)        # turn 2: the turn-end capsule
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P) + len(gen)
    assert ref.check(P + gen + U, b["choices"][0]["token_ids"]) >= 1
    c = server.complete(P + U, max_tokens=8)              # diverges after P: the prompt capsule
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P)
    ref.check(P + U, c["choices"][0]["token_ids"])
    d = server.complete(P[:30] + U, max_tokens=4)         # no capsule at or below 30: cold
    assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_n_forks_share_one_prefill(server):
    c, model = server.client(), server.model
    P = rand_ids(30, 6)
    kw = dict(model=model, prompt=P, max_tokens=10, temperature=1.0, seed=11)
    r = c.completions.create(n=3, **kw)
    assert r.usage.prompt_tokens == 30 and r.usage.prompt_tokens_details.cached_tokens == 0
    outs = [ch.model_extra["token_ids"] for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert len({tuple(o) for o in outs}) >= 2          # independent sampling streams
    again = c.completions.create(n=3, **kw)
    assert [ch.model_extra["token_ids"] for ch in sorted(again.choices, key=lambda ch: ch.index)] == outs
    assert again.usage.prompt_tokens_details.cached_tokens == 30
    one = c.completions.create(n=1, **{**kw, "seed": 12})    # choice i samples with seed + i
    assert one.choices[0].model_extra["token_ids"] == outs[1]


# ---- barge-in ----------------------------------------------------------------------------------
def _stream_then_cancel(server, path, body, k_min, delivered=None):
    """Stream, read until token_index >= k_min, cancel with what was read; (id, read ids, reply)."""
    with httpx.stream("POST", server.url + path, json=body, headers=server.headers(), timeout=60) as r:
        got, rid = [], None
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            rid = ev["id"]
            got += ev["choices"][0]["token_ids"]
            if ev["choices"][0]["token_index"] is not None and ev["choices"][0]["token_index"] >= k_min:
                break
        cpath = ("/v1/chat/completions/" if "chat" in path else "/v1/completions/") + rid + "/cancel"
        reply = server.post(cpath, delivered if delivered is not None else {"delivered_tokens": len(got)})
    assert reply.status_code == 200, reply.text
    return rid, got, reply.json()


def test_barge_in_stateless_completions(server, ref):
    P = rand_ids(48, 7)
    body = {"model": server.model, "prompt": P, "max_tokens": 300, "temperature": 0, "stream": True}
    _, got, reply = _stream_then_cancel(server, "/v1/completions", body, 4)
    k = reply["kept_tokens"][0]
    assert k == len(got) >= 5
    ref.check(P, got)
    U = rand_ids(5, 8)
    nxt = server.complete(P + got + U, max_tokens=6)      # appends: nothing re-prefilled
    assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P) + k
    assert ref.check(P + got + U, nxt["choices"][0]["token_ids"]) >= 1


def test_barge_in_on_a_later_turn(tiny, ref, tmp_path):
    """One session, so turn 2 continues its own history, whose stored turn end is a delta
    capsule (parent by id): a barge-in rolls back from it. That raised 'delta capsule ...
    needs its parent ..., which is not attached' and kept nothing."""
    server = Server(tiny, "--max-sessions", "1", "--max-seq-len", "4096", "--capsule-budget-mb", "4096",
                    log=tmp_path / "one.log")
    try:
        P = rand_ids(40, 11)
        first = server.complete(P, max_tokens=16, ignore_eos=True)["choices"][0]["token_ids"]
        P2 = P + first + rand_ids(6, 12)
        body = {"model": server.model, "prompt": P2, "max_tokens": 16, "temperature": 0, "stream": True,
                "ignore_eos": True}
        _, got, reply = _stream_then_cancel(server, "/v1/completions", body, 4)
        k = reply["kept_tokens"][0]
        assert k == len(got) >= 5
        ref.check(P2, got)
        U = rand_ids(5, 13)
        nxt = server.complete(P2 + got + U, max_tokens=6)
        assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P2) + k
        assert ref.check(P2 + got + U, nxt["choices"][0]["token_ids"]) >= 1
    finally:
        server.stop()


def test_barge_in_stateless_chat(server, ref):
    tok, tpl = ByteTokenizer(VOCAB), ChatTemplate(server_ckpt(server))
    msgs = [{"role": "system", "content": "You are a voice agent."}, {"role": "user", "content": "Tell me"}]
    P = tok.encode(tpl.render(msgs))
    body = {"model": server.model, "messages": msgs, "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        text, ids = "", []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                text += ev["choices"][0]["delta"].get("content") or ""
                ids += ev["choices"][0]["token_ids"]
                if len(ids) >= 8:
                    break
        spoken = len(text) // 2
        reply = server.post(f"/v1/chat/completions/{ev['id']}/cancel", {"delivered_chars": spoken}).json()
    k = reply["kept_tokens"][0]
    assert isinstance(k, int) and k <= len(ids)
    assert len(tok.decode(ids[:k])) <= spoken             # only tokens wholly spoken are kept
    nxt_msgs = msgs + [{"role": "assistant", "content": text[:spoken]}, {"role": "user", "content": "ok"}]
    N = tok.encode(tpl.render(nxt_msgs))
    held = P + ids[:k]
    common = next((i for i, (a, b) in enumerate(zip(N, held)) if a != b), min(len(N), len(held)))
    r = server.client().chat.completions.create(model=server.model, messages=nxt_msgs, max_tokens=4,
                                                temperature=0)
    # stored boundaries: the prompt end and prompt + kept; the deepest one the new prompt reaches
    want = len(held) if common >= len(held) else len(P)
    assert r.usage.prompt_tokens_details.cached_tokens == want
    ref.check(N, r.choices[0].model_extra["token_ids"])


def test_sessions_barge_in_disconnect_rollback_fork(server, ref):
    P = rand_ids(32, 9)
    s = server.post("/v1/sessions", {"prompt": P}).json()
    sid = s["id"]
    assert s["position"] == 32 and len(sid) > 20
    body = {"model": server.model, "prompt": rand_ids(4, 10), "max_tokens": 300, "temperature": 0,
            "stream": True}
    _, got, reply = _stream_then_cancel(server, f"/v1/sessions/{sid}/completions", body, 3)
    hist = P + rand_ids(4, 10) + got
    assert server.post(f"/v1/sessions/{sid}/snapshot").status_code == 200
    info = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    assert info["tokens"] == hist
    snap = info["snapshots"][0]
    turn = server.post(f"/v1/sessions/{sid}/completions", {"prompt": [5, 6], "max_tokens": 4,
                                                           "temperature": 0}).json()
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] == len(hist)
    ref.check(hist + [5, 6], turn["choices"][0]["token_ids"])
    # a bare disconnect keeps a prefix of what was generated, and the next turn appends to it
    before = httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens"]
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/completions", timeout=60,
                      json={**body, "prompt": [7]}) as r:
        read = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                read += json.loads(line[6:])["choices"][0]["token_ids"]
                if len(read) >= 3:
                    break
    for _ in range(100):
        now = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
        if not now["busy"]:
            break
        import time
        time.sleep(0.05)
    kept = now["tokens"][len(before) + 1:]
    assert now["tokens"][: len(before) + 1] == before + [7] and len(read) <= len(kept) < 300
    ref.check(before + [7], kept)
    nxt = server.post(f"/v1/sessions/{sid}/completions", {"prompt": [8], "max_tokens": 2}).json()
    assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] == len(now["tokens"])
    # rollback to the end of P, restore the snapshot, fork
    rb = server.post(f"/v1/sessions/{sid}/rollback", {"position": 32}).json()
    assert rb["tokens"] == P
    t2 = server.post(f"/v1/sessions/{sid}/completions", {"prompt": [9], "max_tokens": 3, "temperature": 0}).json()
    assert t2["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    ref.check(P + [9], t2["choices"][0]["token_ids"])
    assert server.post(f"/v1/sessions/{sid}/restore", {"snapshot_id": snap}).json()["tokens"] == hist
    f = server.post(f"/v1/sessions/{sid}/fork").json()
    assert f["id"] != sid and f["tokens"] == hist
    # errors: unknown ids, bad positions, save without a capsule dir
    assert httpx.get(f"{server.url}/v1/sessions/sess-nope").status_code == 404
    assert server.post(f"/v1/sessions/{sid}/rollback", {"position": 10**6}).status_code == 400
    assert server.post(f"/v1/sessions/{sid}/restore", {"snapshot_id": "x"}).status_code == 404
    assert server.post(f"/v1/sessions/{sid}/save", {"name": "a"}).status_code == 400


# ---- concurrency -------------------------------------------------------------------------------
def test_eight_concurrent_clients(server, ref):
    def client(i):
        P = rand_ids(24 + i, 100 + i)
        a = server.complete(P, max_tokens=10)
        gen = a["choices"][0]["token_ids"]
        U = rand_ids(3, 200 + i)
        b = server.complete(P + gen + U, max_tokens=6)
        return P, gen, U, a, b
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(client, range(8)))
    for P, gen, U, a, b in results:
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P) + len(gen)  # nothing lost
        ref.check(P, gen)                                   # nobody else's state leaked in
        ref.check(P + gen + U, b["choices"][0]["token_ids"])


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "invalid JSON"),
    ({"model": "gpt-4", "prompt": [1]}, 404, "unknown model"),
    ({"prompt": [1], "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": [1], "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": [1], "temperature": -0.5}, 400, "temperature"),
    ({"prompt": [1], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1], "top_p": 1.5}, 400, "top_p"),
    ({"prompt": [1, 2, VOCAB]}, 400, "outside the vocabulary"),
    ({"prompt": [1] * 600}, 400, "max_seq_len"),
    ({"prompt": [1], "logprobs": 3, "best_of": 2}, 400, "best_of, logprobs"),
    ({"prompt": [1], "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": []}, 400, "empty"),
])
def test_bad_input_named(server, body, status, needle):
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_bad_input_keeps_serving_and_storing(server):
    P = rand_ids(20, 300)
    a = server.complete(P, max_tokens=4)
    big = httpx.post(server.url + "/v1/completions", content=b"x" * (9 << 20), timeout=30)
    assert big.status_code == 413 and "exceeds" in big.json()["error"]["message"]
    assert server.post("/v1/chat/completions/chatcmpl-nope/cancel", {}).status_code == 404
    assert server.post("/v1/chat/completions", {"messages": []}).status_code == 400
    b = server.complete(P + a["choices"][0]["token_ids"], max_tokens=2)
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 20 + len(a["choices"][0]["token_ids"])


# ---- a real BPE tokenizer and a template that drops earlier reasoning -----------------------------
QWEN_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    # earlier turns' reasoning is dropped, as Qwen3's template does
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def bpe_ckpt(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from flashrt.models import make_checkpoint
    d = tmp_path_factory.mktemp("bpe")
    make_checkpoint("qwen3_5", "tiny", d, seed=0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["You are a helpful voice agent. The answer is short and kind.",
              "Tell me about the weather today, and what the reasoning behind it is.",
              "system user assistant think answer reasoning weather today tomorrow"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": QWEN_STYLE,
        "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>"}))
    return d


def test_reasoning_template_rolls_back_to_the_divergence(bpe_ckpt, tmp_path):
    from tokenizers import Tokenizer
    tk = Tokenizer.from_file(str(bpe_ckpt / "tokenizer.json"))
    enc, tpl = (lambda t: tk.encode(t).ids), ChatTemplate(bpe_ckpt)
    assert tpl.kind == "checkpoint"
    s, ref = Server(bpe_ckpt, log=tmp_path / "bpe.log"), Reference(bpe_ckpt)
    try:
        c = s.client()
        msgs = [{"role": "system", "content": "You are a helpful voice agent."},
                {"role": "user", "content": "Tell me about the weather today."}]
        P1 = enc(tpl.render(msgs))
        r1 = c.chat.completions.create(model=s.model, messages=msgs, max_tokens=3, temperature=0)
        assert r1.usage.prompt_tokens == len(P1)             # the server tokenizes as we do
        answer = "<think>\nThe reasoning behind it.\n</think>\n\nThe answer is short."
        think = enc(answer)
        # the turn as a reasoning model would have produced it: held after the prompt capsule
        r2 = s.complete(P1 + think, max_tokens=2)
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P1)
        msgs2 = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And tomorrow?"}]
        N = enc(tpl.render(msgs2))
        assert N[: len(P1)] == P1 and N[len(P1)] != think[0]  # re-rendered without the reasoning
        r3 = c.chat.completions.create(model=s.model, messages=msgs2, max_tokens=6, temperature=0)
        # rolled back to the divergence (the prompt capsule), only the rest prefilled
        assert r3.usage.prompt_tokens_details.cached_tokens == len(P1)
        assert r3.usage.prompt_tokens == len(N)
        ref.check(N, r3.choices[0].model_extra["token_ids"])
    finally:
        s.stop()


# ---- API key, and a restart that reuses the disk tier ----------------------------------------------
def test_api_key_and_restart_with_disk_tier(tiny, tmp_path, ref):
    import openai
    caps, key = tmp_path / "caps", "s3cret-key"
    a = Server(tiny, "--capsule-dir", str(caps), api_key=key, log=tmp_path / "a.log")
    try:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/health"),
                             ("POST", "/v1/chat/completions"), ("POST", "/v1/sessions"),
                             ("GET", "/v1/sessions/sess-x"), ("POST", "/v1/completions/cmpl-x/cancel")]:
            for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                r = httpx.request(method, a.url + path, json={}, headers=hdr, timeout=30)
                assert r.status_code == 401 and "API key" in r.json()["error"]["message"], (path, hdr)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=a.url + "/v1", api_key="wrong", max_retries=0).models.list()
        P = rand_ids(36, 500)
        gen = a.complete(P, max_tokens=6)["choices"][0]["token_ids"]
        P2 = rand_ids(20, 501)
        sid = a.post("/v1/sessions", {"prompt": P2}).json()["id"]
        assert a.post(f"/v1/sessions/{sid}/save", {"name": "alice"}).status_code == 200
    finally:
        a.stop()
    assert any(p.suffix == ".capsule" for p in caps.iterdir())
    b = Server(tiny, "--capsule-dir", str(caps), api_key=key, log=tmp_path / "b.log")
    try:
        U = rand_ids(4, 502)
        r = b.complete(P + gen + U, max_tokens=5)
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P) + len(gen)
        ref.check(P + gen + U, r["choices"][0]["token_ids"])
        loaded = b.post("/v1/sessions/load", {"name": "alice"}).json()
        assert loaded["tokens"] == P2
        t = b.post(f"/v1/sessions/{loaded['id']}/completions", {"prompt": [3], "max_tokens": 2}).json()
        assert t["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P2)
        assert b.post("/v1/sessions/load", {"name": "bob"}).status_code == 404
    finally:
        b.stop()


# ---- a small pool: queue full, a disconnect frees the slot, a pinned prefix outlives eviction -------
def test_queue_full_disconnect_and_pinned_prefix(tiny, tmp_path):
    s = Server(tiny, "--max-sessions", "1", "--max-queue", "1", "--capsule-budget-mb", "0.2",
               "--max-seq-len", "4096", log=tmp_path / "small.log")
    try:
        # long enough to still be running when the third request comes (a tiny step is ~ms)
        body = {"model": s.model, "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True}
        url = s.url + "/v1/completions"
        with httpx.stream("POST", url, json={**body, "prompt": rand_ids(8, 600)}, timeout=60) as r1:
            lines = r1.iter_lines()            # kept alive: dropping it would close the stream
            next(line for line in lines if line.startswith("data: {"))              # running
            with httpx.stream("POST", url, json={**body, "prompt": rand_ids(8, 601)}, timeout=60) as r2:
                assert r2.status_code == 200                                         # queued
                r3 = httpx.post(url, json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
                assert r3.status_code == 429 and r3.headers["retry-after"] == "1"
                assert "queue full" in r3.json()["error"]["message"]
        # both clients went away without a word: their slot and queue place are free again
        s.complete(rand_ids(5, 602), max_tokens=2)
        system, other = rand_ids(30, 700), rand_ids(30, 701)
        s.complete(system + rand_ids(5, 702), max_tokens=2, pin_prefix=30)
        s.complete(other + rand_ids(5, 703), max_tokens=2)
        for i in range(12):                     # other conversations evict every unpinned capsule
            s.complete(rand_ids(60, 800 + i), max_tokens=3)
        pinned = s.complete(system + rand_ids(5, 704), max_tokens=2)
        assert pinned["usage"]["prompt_tokens_details"]["cached_tokens"] == 30
        evicted = s.complete(other + rand_ids(5, 705), max_tokens=2)
        assert evicted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        bad = s.post("/v1/completions", {"prompt": [1], "pin_prefix": 5})
        assert bad.status_code == 400 and "pin_prefix" in bad.json()["error"]["message"]
    finally:
        s.stop()
