"""Constrained decoding (flashrt/lm/grammar.py) on the tiny random-weight models: output always in
the grammar (json_schema, json_object, tool calls), the grammar state following rollback, fork,
snapshot/restore (disk too) and speculative rounds, and the refusals (unsupported keywords,
bounds). Weights are random: the JSON is valid, its content meaningless."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

import flashrt
from flashrt.lm import Constraint, Grammar, GrammarOptions, Grammars
from flashrt.lm.grammar import new_bitmask, vocabulary

xgr = pytest.importorskip("xgrammar")

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
SEEDS = range(12)


def _ids(n, seed=0, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _valid(obj) -> bool:
    """SCHEMA, checked by hand (independent of xgrammar)."""
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "tags", "ok"}
            and isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and type(obj["age"]) is int and 0 <= obj["age"] <= 120
            and isinstance(obj["tags"], list) and len(obj["tags"]) <= 2
            and all(t in ("a", "b") for t in obj["tags"]) and isinstance(obj["ok"], bool))


def _text(out) -> str:
    """A stopped run's text, its stop token dropped (the byte tokenizer: ids < 256 are bytes)."""
    assert all(t < 256 for t in out[:-1]), out
    return bytes(out[:-1]).decode("utf-8")


def _replays(rt, g, out) -> bool:
    """A fresh matcher accepts `out`: a prefix the grammar allows."""
    c = Constraint(g, rt.grammars, 0)
    return all(c.accept(t) for t in out)


def _generate_all(rt, g, temperature, n=160):
    """One run per seed from a fresh context: [(tokens, finish_reason)]."""
    runs = []
    for seed in SEEDS:
        rt.reset()
        out = rt.generate(_ids(8, seed), max_new_tokens=n, temperature=temperature, seed=seed,
                          grammar=g)
        runs.append((out, rt.finish_reason))
        assert rt.finish_reason in ("stop", "length"), rt.finish_reason
        assert _replays(rt, g, out)
    return runs


def _plain(rt, prompt, g, n):
    """Plain greedy under g by decode(): (tokens, the masked logits each was chosen from)."""
    logits = rt.prefill(prompt)
    logits = rt.constrain(g).mask(logits.clone())
    toks, rows = [], []
    while len(toks) < n and not rt.constraint.terminated:
        rows.append(logits)
        toks.append(int(logits.argmax()))
        logits = rt.decode(toks[-1])
    return toks, torch.stack(rows)


def _same_up_to_near_ties(got, want, rows, margin=1e-3):
    """got == want, or they part where the plain run's top-2 masked gap is a near-tie (a
    batched verify step changes logit bits by ~1e-6: speculative.py)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top2 = rows[i].topk(2).values
            assert float(top2[0] - top2[1]) <= margin, f"token {i}: {a} vs plain {b}"
            return
    assert got == want


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_is_always_valid(temperature, runtime):
    rt = runtime("qwen3", max_seq_len=192)
    g = Grammar.json_schema(SCHEMA, strict=True, max_whitespace=1)
    runs = _generate_all(rt, g, temperature)
    done = [(out, r) for out, r in runs if r == "stop"]
    assert 2 * len(done) >= len(runs), [r for _, r in runs]   # the check is not vacuous
    for out, _ in done:
        assert out[-1] in rt.model.eos_ids
        obj = json.loads(_text(out))
        assert _valid(obj), obj


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_object(temperature, runtime):
    rt = runtime("qwen3", max_seq_len=192)
    runs = _generate_all(rt, Grammar.json_object(max_whitespace=1), temperature, n=96)
    for out, reason in runs:
        if reason == "stop":
            assert isinstance(json.loads(_text(out)), dict)


@pytest.mark.parametrize("reasoning", ["enabled", "auto"])
def test_json_after_the_reasoning_block(reasoning, runtime):
    """reasoning="enabled" (the prompt ended in <think>): think text, then </think> and the
    JSON; "auto": the block is optional. The think text is forced here by decode() (random
    weights would think forever), the JSON generated."""
    g = Grammar.json_schema(SCHEMA, reasoning=reasoning, max_whitespace=1)
    rt = runtime("qwen3", max_seq_len=192)
    eos = rt.model.eos_ids[0]
    for forced in ('{"name":"a","age":1,"tags":[],"ok":true}',            # JSON right away
                   ("" if reasoning == "enabled" else "<think>") + "hm {}</think>\n\n"):
        rt.reset()
        rt.prefill(_ids(6, 18))
        rt.constrain(g)
        for b in forced.encode():
            logits = rt.decode(b)
        if forced.startswith("{"):    # "enabled": still thinking, so no end yet; "auto": done
            assert torch.isinf(logits[eos]) == (reasoning == "enabled")
    out = rt.generate(max_new_tokens=120, grammar=g)
    assert rt.finish_reason == "stop" and _valid(json.loads(_text(out)))


def _calls(text):
    return re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, flags=re.S)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["required", NAMED])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_call_always_parses(choice, temperature, runtime):
    rt = runtime("qwen3", max_seq_len=192)
    g = Grammar.tool_calls(TOOLS, choice=choice, parallel=False, fmt="qwen_3", max_whitespace=1)
    runs = _generate_all(rt, g, temperature)
    done = [out for out, r in runs if r == "stop"]
    assert done, [r for _, r in runs]
    for out in done:
        calls = _calls(_text(out))
        assert len(calls) == 1, _text(out)                    # parallel=False: exactly one
        call = json.loads(calls[0])
        assert set(call) == {"name", "arguments"}
        if isinstance(choice, dict):
            assert call["name"] == "get_weather"
        args = call["arguments"]
        if call["name"] == "get_weather":
            assert set(args) == {"city", "days"} and isinstance(args["city"], str)
            assert type(args["days"]) is int and 1 <= args["days"] <= 7
        else:
            assert call["name"] == "ping" and args == {}


def test_qwen_3_5_xml_tool_call(runtime):
    rt = runtime("qwen3", max_seq_len=192)
    g = Grammar.tool_calls(TOOLS[:1], choice="required", parallel=False, fmt="qwen_3_5",
                           max_whitespace=1)
    done = [out for out, r in _generate_all(rt, g, 0.0) if r == "stop"]
    assert done
    for out in done:
        text = _text(out)
        m = re.search(r"<tool_call>\n<function=get_weather>\n(.*)</function>\n</tool_call>", text, re.S)
        assert m, text
        params = dict(re.findall(r"<parameter=(\w+)>(.*?)</parameter>", m.group(1), re.S))
        assert set(params) == {"city", "days"} and 1 <= int(params["days"].strip()) <= 7


# ---- the grammar state follows the model state -------------------------------------------
def _masks(c) -> torch.Tensor:
    m = new_bitmask(1, c.grammars.vocab_size)
    c.fill(m)
    return m


def _allowed(mask, V) -> set:
    return {i for i in range(V) if int(mask[0, i // 32]) >> (i % 32) & 1}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_rollback_mid_json_then_continue(arch, temperature, runtime):
    """Rolled back to a checkpoint boundary (bitwise state), the matcher is where a fresh one
    replaying the kept ids is, and the continuation is the run that never rolled back."""
    g = Grammar.json_schema(SCHEMA, max_whitespace=1)
    prompt = _ids(16, 3)
    kw = dict(checkpoint_every=8, prefill_chunk=16)
    ref = runtime(arch, **kw)
    head = ref.generate(prompt, max_new_tokens=8, temperature=temperature, seed=1, grammar=g)
    assert ref.finish_reason == "length" and len(ref.constraint.ids) == 8
    want = ref.generate(max_new_tokens=20, temperature=temperature, seed=2)

    rt = runtime(arch, **kw)
    assert rt.generate(prompt, max_new_tokens=8, temperature=temperature, seed=1, grammar=g) == head
    rt.generate(max_new_tokens=9, temperature=temperature, seed=7, grammar=g)   # continues it
    assert len(rt.constraint.ids) == 8 + 9
    rt.rollback(24)                                               # mid-JSON, a checkpoint
    assert rt.constraint.ids == head and rt.tokens == prompt + head
    assert torch.equal(_masks(rt.constraint), _masks(Constraint(g, rt.grammars, 16, head)))
    assert rt.generate(max_new_tokens=20, temperature=temperature, seed=2) == want
    rt.rollback(12)                                               # before the grammar: it ends
    assert rt.constraint is None


def test_constrain_continues_a_kept_grammar_state(runtime):
    """constrain(g, accepted=ids): a grammar state its caller kept (a server session's) goes
    on from the history's last tokens, as the run that never left it; ids that are not the
    history's tail are refused with the state untouched."""
    g = Grammar.json_schema(SCHEMA, max_whitespace=1)
    prompt = _ids(10, 12)
    ref = runtime("qwen3")
    head = ref.generate(prompt, max_new_tokens=6, grammar=g)
    want = ref.generate(max_new_tokens=20)
    rt = runtime("qwen3")
    rt.prefill(prompt + head)                    # the context is the caller's: no grammar
    with pytest.raises(ValueError, match="not the last tokens"):
        rt.constrain(g, accepted=head[:3])      # generated, but not where the history ends
    assert rt.constraint is None
    assert rt.constrain(g, accepted=head).start == 10
    assert rt.generate(max_new_tokens=20) == want and rt.constraint.ids == head + want


@pytest.mark.parametrize("share", [False, True])
def test_fork_and_restore_continue_bitwise(share, runtime, tmp_path):
    g = Grammar.json_schema(SCHEMA, max_whitespace=1)
    rt = runtime("qwen3")
    rt.generate(_ids(12, 5), max_new_tokens=7, temperature=0.8, seed=4, grammar=g)
    cap = rt.snapshot()
    rec = cap.meta.extra["grammar"]
    assert rec["key"] == g.key and rec["start"] == 12 and rec["ids"] == rt.constraint.ids
    flashrt.save_capsule(cap, tmp_path / "g.cap")
    live, kid = rt.fork(share=share), rt.fork(cap, share=share)
    other = runtime("qwen3")                                      # another session: from disk
    other.restore(flashrt.load_capsule(tmp_path / "g.cap"))
    want = rt.generate(max_new_tokens=30, temperature=0.8)
    for s in (live, kid, other):
        assert s.generate(max_new_tokens=30, temperature=0.8) == want
        assert s.constraint.ids == rt.constraint.ids and s.finish_reason == rt.finish_reason
    rt.restore(cap)                                               # and back on the source
    assert rt.constraint.ids == rec["ids"] and rt.generate(max_new_tokens=30, temperature=0.8) == want


def test_n_forks_are_independent(runtime):
    """n > 1: forks of one prompt under one grammar, each with its own seed; running one does
    not move another's grammar state, nor the parent's."""
    g = Grammar.json_schema(SCHEMA, max_whitespace=1)
    parent = runtime("qwen3")
    parent.prefill(_ids(10, 6))
    parent.constrain(g)
    alone = parent.fork(seed=2).generate(max_new_tokens=40, temperature=1.0)
    a, b = parent.fork(seed=1), parent.fork(seed=2)
    out_a = a.generate(max_new_tokens=40, temperature=1.0)
    assert b.generate(max_new_tokens=40, temperature=1.0) == alone
    assert out_a != alone and a.constraint.ids == out_a and parent.constraint.ids == []


def test_decode_forces_under_the_grammar(runtime):
    """decode() accepts a token the grammar allows and returns the masked logits; a token it
    refuses is a ValueError with the state untouched; prefill ends the grammar."""
    g = Grammar.json_object()
    rt = runtime("qwen3")
    logits = rt.prefill(_ids(6, 8))
    c = rt.constrain(g)
    masked = c.mask(logits.clone())
    assert torch.isinf(masked[ord("a")]) and not torch.isinf(masked[ord("{")])
    P, before = rt.position, rt.arena["meta.logits"].clone()
    with pytest.raises(ValueError, match="not allowed by the active grammar"):
        rt.decode(ord("a"))
    assert rt.position == P and c.ids == [] and torch.equal(rt.arena["meta.logits"], before)
    out = rt.decode(ord("{"))
    assert c.ids == [ord("{")] and torch.isinf(out[ord("a")]) and not torch.isinf(out[ord('"')])
    rt.prefill(_ids(3, 9))
    assert rt.constraint is None


def test_greedy_by_decode_equals_generate(runtime):
    """The server's path (decode returns masked logits, argmax) is generate(grammar=); under
    a grammar EOS stops even with ignore_eos."""
    g = Grammar.json_schema(SCHEMA, max_whitespace=1)
    prompt = _ids(9, 10)
    rt = runtime("qwen3")
    want = rt.generate(prompt, max_new_tokens=160, grammar=g, ignore_eos=True)
    assert rt.finish_reason == "stop" and want[-1] in rt.model.eos_ids
    assert _plain(runtime("qwen3"), prompt, g, 160)[0] == want


def test_graph_bodies_step_but_the_mask_is_outside(runtime, monkeypatch):
    """With step bodies (what CUDA captures; run eagerly here), a grammar bypasses the fused
    decode body (its on-device draw knows no mask): the size-1 step body runs, the mask and the
    draw happen outside it, and the output is the eager run's (up to near-ties)."""
    g = Grammar.json_schema(SCHEMA, max_whitespace=1)
    prompt = _ids(8, 17)                                          # one size-8 step body
    want, rows = _plain(runtime("qwen3"), prompt, g, 40)
    rt = runtime("qwen3")
    graphs = rt.use_graph_bodies()
    calls = []
    monkeypatch.setattr(graphs, "generate", lambda *a: pytest.fail("fused decode body under a grammar"))
    monkeypatch.setattr(graphs, "call", lambda key, call=graphs.call: calls.append(key) or call(key))
    got = rt.generate(prompt, max_new_tokens=40, grammar=g)
    _same_up_to_near_ties(got, want, rows)
    assert calls.count(1) == len(got) and "decode" not in calls and "sample" not in calls


# ---- speculative decoding under a grammar ------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_equals_plain_under_grammar(k, runtime):
    g = Grammar.json_schema(SCHEMA, max_whitespace=1)
    prompt = _ids(12, 11)
    want, rows = _plain(runtime("qwen3_5"), prompt, g, 40)
    rt = runtime("qwen3_5")
    got = rt.generate(prompt, max_new_tokens=40, grammar=g, speculative="mtp", draft_tokens=k)
    _same_up_to_near_ties(got, want, rows)
    assert rt.constraint.ids == got and rt.tokens == prompt + got
    assert rt.speculation().stats["drafted"] > 0


@pytest.mark.parametrize("err", [None, ("refused", 0), ("refused", 1), ("wrong", 0), ("wrong", 1)])
def test_injected_drafts_checked_against_the_masks(err, runtime):
    """An oracle drafting the plain continuation gives the plain output; with draft j replaced
    by a token the grammar refuses, drafts stop before it (never verified); with one it allows
    but the model does not pick, the verify rejects it and the trial drafts are rolled back."""
    g = Grammar.json_schema(SCHEMA, max_whitespace=1)
    prompt = _ids(10, 12)
    want, rows = _plain(runtime("qwen3"), prompt, g, 30)

    def drafter(rt, k):
        i = len(rt.tokens) - len(prompt)                   # the pending token is want[i]
        d = [want[i + 1 + j] if i + 1 + j < len(want) else 0 for j in range(k)]
        if err is not None and err[1] < k:
            kind, j = err
            trial = rt.constraint.fork()                   # it has accepted the pending token
            if kind == "wrong" and all(trial.accept(t) for t in d[:j]):
                d[j] = min(_allowed(_masks(trial), 512) - {d[j]}, default=d[j])
            elif kind == "refused":
                d[j] = 1                                   # a control byte: never in JSON
        return d
    rt = runtime("qwen3")
    got = rt.generate(prompt, max_new_tokens=30, grammar=g, speculative="draft", drafter=drafter,
                      draft_tokens=3)
    _same_up_to_near_ties(got, want, rows)
    assert rt.constraint.ids == got
    st = rt.speculation().stats
    if err is None or err == ("refused", 1):
        assert st["drafted"] == st["accepted"] > 0
    elif err == ("refused", 0):
        assert st["drafted"] == 0
    else:
        assert st["drafted"] > st["accepted"]


def test_decoder_rounds_under_a_constraint(runtime):
    """The server's round-at-a-time path: rt.constrain, then decoder(constraint=)."""
    g = Grammar.json_schema(SCHEMA, max_whitespace=1)
    prompt = _ids(12, 13)
    want, rows = _plain(runtime("qwen3_5"), prompt, g, 30)
    rt = runtime("qwen3_5")
    rt.prefill(prompt)
    dec = rt.speculation().decoder(2, constraint=rt.constrain(g))
    out = [dec.first()]
    while dec.pending is not None and dec.pending not in rt.model.eos_ids and len(out) < 30:
        out += dec.next(30 - len(out), set(rt.model.eos_ids))
    dec.close()
    _same_up_to_near_ties(out, want, rows)
    assert rt.constraint.ids == out


def test_sampled_speculative_output_is_valid(runtime):
    g = Grammar.json_schema(SCHEMA, max_whitespace=1)
    rt = runtime("qwen3_5", max_seq_len=192)
    for seed in range(6):
        rt.reset()
        out = rt.generate(_ids(8, seed), max_new_tokens=120, temperature=1.0, seed=seed, grammar=g,
                          speculative="mtp", draft_tokens=2)
        assert _replays(rt, g, out)
        if rt.finish_reason == "stop":
            assert _valid(json.loads(_text(out)))


# ---- specs, vocabularies, refusals -------------------------------------------------------
def test_keys_are_stable_and_records_checked():
    a, b = Grammar.json_schema(SCHEMA), Grammar.json_schema(json.dumps(SCHEMA))
    assert a.key == b.key and a.key != Grammar.json_schema(SCHEMA, strict=False).key
    assert Grammar.json_object().key != a.key
    rec = {"kind": a.kind, "spec": a.spec, "key": a.key}
    assert Grammar.from_record(rec) == a
    with pytest.raises(ValueError, match="is not the spec's"):
        Grammar.from_record({**rec, "spec": a.spec.replace("120", "121")})


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "'not'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if'"),
    ({"type": "string", "format": "credit-card"}, "'format'"),
])
def test_unsupported_schema_names_the_keyword(schema, keyword):
    with pytest.raises(ValueError, match=keyword):
        Grammar.json_schema(schema)
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(ValueError, match=keyword):
        Grammar.tool_calls(tools)


def test_refused_before_any_state_changes(runtime):
    rt = runtime("qwen3")
    rt.prefill(_ids(5, 14))
    P = rt.position
    lookahead = Grammar.json_schema({"type": "string", "pattern": "a(?=b)"})
    with pytest.raises(ValueError, match="'pattern'"):
        rt.generate(_ids(4, 15), grammar=lookahead)
    assert rt.position == P and rt.constraint is None
    with pytest.raises(ValueError, match="names no tool"):
        Grammar.tool_calls(TOOLS, choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="unique"):
        Grammar.tool_calls(TOOLS + TOOLS[:1])


@pytest.mark.parametrize("option,match", [
    (dict(max_spec_bytes=64), "max_spec_bytes"), (dict(max_grammar_bytes=64), "max_grammar_bytes"),
    (dict(max_compile_s=1e-9), "max_compile_s")])
def test_bounds_refuse_with_a_clear_error(option, match, ckpt):
    rt = flashrt.lm.load(ckpt("qwen3"), max_seq_len=64, dtype="float32",
                         grammar=GrammarOptions(**option))
    rt.prefill(_ids(5, 16))
    g = Grammar.json_schema(SCHEMA)
    for _ in range(2):                                  # and a refused key stays refused
        with pytest.raises(ValueError, match=match):
            rt.constrain(g)
    assert rt.constraint is None


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 4}])
def test_json_strings_are_json_text(schema, runtime):
    """xgrammar 0.2.9's string classes admit raw control characters (bounded length) and UTF-16
    surrogates; the grammar built here admits neither, and still every other character."""
    c = Constraint(Grammar.json_schema(schema), runtime("qwen3").grammars, 0)
    assert c.accept(ord('"'))
    inside = _allowed(_masks(c), 512)
    assert not inside & set(range(0x20)) and {ord("a"), 0x7F, 0xC3, 0xED, 0xF0} <= inside
    assert c.accept(0xED)
    assert _allowed(_masks(c), 512) == set(range(0x80, 0xA0))   # not the surrogates' A0-BF


def _bpe_tokenizer():
    """A byte-level BPE like Qwen's: <|im_end|> special (the EOS), <tool_call> a plain added token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_end|>"])
    tok.train_from_iterator(['{"name": "x", "arguments": {"city": "Paris"}}'] * 50, trainer)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    return tok


def test_vocabulary_from_a_tokenizer_json(tmp_path):
    """TokenizerInfo from tokenizer.json: masks equal xgrammar's own from_huggingface except
    that a special token is never text; <tool_call> (not special) is the structural tag's."""
    from transformers import PreTrainedTokenizerFast
    tok = _bpe_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    V, eos = 416, tok.token_to_id("<|im_end|>")
    model = SimpleNamespace(net=SimpleNamespace(vocab_size=V), eos_ids=(eos,), path=tmp_path,
                            tokenizer=SimpleNamespace(kind="hf"))
    ours = Grammars(model)
    theirs = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=V, stop_token_ids=[eos]))
    special = tok.token_to_id("<|endoftext|>")
    for g in (Grammar.json_schema(SCHEMA), Grammar.tool_calls(TOOLS, fmt="qwen_3")):
        c = Constraint(g, ours, 0)
        m = xgr.GrammarMatcher(theirs.compile_grammar(g.build()))
        for text in ("", '{"name": "Pa', '<tool_call>\n{"name": "get_weather", "arguments": {"c'):
            if not text or c.matcher().accept_string(text) and m.accept_string(text):
                b = new_bitmask(1, V)
                m.fill_next_token_bitmask(b)
                mine, xgrs = _allowed(_masks(c), V), _allowed(b, V)
                assert special not in mine and mine ^ xgrs in (set(), {special}), text
    c = Constraint(Grammar.tool_calls(TOOLS, fmt="qwen_3"), ours, 0)
    assert c.accept(tok.token_to_id("<tool_call>"))
    assert vocabulary(model).vocab_size == V


def test_without_a_tokenizer_json_is_refused(tmp_path):
    model = SimpleNamespace(net=SimpleNamespace(vocab_size=300), eos_ids=(), path=tmp_path,
                            tokenizer=SimpleNamespace(kind="hf"))
    with pytest.raises(ValueError, match="tokenizer.json"):
        Grammars(model).compile(Grammar.json_object())

