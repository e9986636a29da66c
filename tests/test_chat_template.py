"""flashrt.chat's templates: the released chat templates render exactly as transformers rendered
them (goldens made once by tests/golden/make_chat_goldens.py), prepare_messages turns what
clients send back in a tool loop into what the templates need, and a three-step tool loop is
prefix-stable per family: the step-1 prompt + the generated call + the end token is a prefix of
the step-2 prompt, token for token. Where it is not (reasoning dropped by the client, Qwen3 with
thinking off), the tests say where the render diverges. Random-weight checkpoints only."""
from __future__ import annotations

import copy
import json
import pathlib

import pytest

from flashrt.chat import ChatTemplate, prepare_messages, template_kwargs
from flashrt.models.checkpoint import CHAT_TEMPLATES, CHAT_TOKENIZERS, write_chat_tokenizer

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden" / "chat"
GOLDENS = sorted(GOLDEN.glob("*.json"))
CASES = [(p, c["name"]) for p in GOLDENS for c in json.loads(p.read_text())["cases"]]


def _golden(path, name):
    doc = json.loads(path.read_text())
    case = next(c for c in doc["cases"] if c["name"] == name)
    tpl = ChatTemplate.from_source((CHAT_TEMPLATES / doc["template"]).read_text(encoding="utf-8"),
                                   doc["special_tokens"])
    return doc, case, tpl


def test_goldens_cover_every_released_template():
    assert {json.loads(p.read_text())["template"] for p in GOLDENS} == \
        {p.name for p in CHAT_TEMPLATES.glob("*.jinja")}


def test_qwen3_5_small_template_differs_only_in_its_thinking_default():
    """qwen3_5-0.8b.jinja is the family template with the 0.8B's generation prompt (README)."""
    big = (CHAT_TEMPLATES / "qwen3_5.jinja").read_text()
    small = (CHAT_TEMPLATES / "qwen3_5-0.8b.jinja").read_text()
    at = big.rindex("{%- if add_generation_prompt %}")
    assert small[:at] == big[:at] and small[at:] != big[at:]
    assert "enable_thinking is true" in small[at:] and "enable_thinking is false" in big[at:]


@pytest.mark.parametrize("path", GOLDENS, ids=[p.stem for p in GOLDENS])
def test_family_of_released_template(path):
    doc = json.loads(path.read_text())
    assert ChatTemplate.from_source((CHAT_TEMPLATES / doc["template"]).read_text()).family == doc["family"]


@pytest.mark.parametrize("path, name", CASES, ids=[f"{p.stem}-{n}" for p, n in CASES])
def test_render_matches_transformers(path, name):
    doc, case, tpl = _golden(path, name)
    prepared = prepare_messages(copy.deepcopy(case["messages"]), doc["family"])
    assert prepared == case["prepared"]
    kw = dict(tools=case.get("tools"), template_kwargs=case.get("template_kwargs"),
              add_generation_prompt=case.get("add_generation_prompt", True))
    assert tpl.render(prepared, **kw) == case["prompt"]
    if "prompt" in case["raw"]:              # as the client sent it, unprepared
        assert tpl.render(copy.deepcopy(case["messages"]), **kw) == case["raw"]["prompt"]
    else:
        with pytest.raises(ValueError, match="chat template refused"):
            tpl.render(copy.deepcopy(case["messages"]), **kw)
    if "request" in case:
        assert template_kwargs(None, **case["request"]) == case["template_kwargs"]


def test_raw_client_messages_need_preparing():
    """What transformers did with messages as clients send them (recorded in the goldens): content
    null fails every template, string arguments fail Qwen3.5's (`|items`), and the role
    "developer" fails Qwen3.5's and vanishes from Qwen3's."""
    def raw(stem, name):
        return next(c for c in json.loads((GOLDEN / f"{stem}.json").read_text())["cases"]
                    if c["name"] == name)["raw"]
    assert raw("qwen3-0.6b", "tool_call_content_null") == {"error": "UndefinedError"}
    assert raw("lfm2-350m", "tool_call_content_null") == {"error": "TypeError"}
    for stem in ("qwen3_5", "qwen3_5-0.8b"):
        assert raw(stem, "tool_call_with_content") == {"error": "TypeError"}
        assert raw(stem, "developer_role") == {"error": "TemplateError"}
    assert "French" not in raw("qwen3-0.6b", "developer_role")["prompt"]


# ---- prepare_messages -------------------------------------------------------------------------

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_prepare_content_null_and_arguments():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    before = copy.deepcopy(msgs)
    out = prepare_messages(msgs, "qwen3")
    assert msgs == before                                    # the input is not changed
    assert out[1]["content"] == "" and out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[1]["tool_calls"][0]["id"] == "call_1" and out[2]["tool_call_id"] == "call_1"
    spaced = prepare_messages([{**msgs[1], "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": '{ "a" : 1 }'}}]}], "qwen3")
    assert spaced[0]["tool_calls"] == out[1]["tool_calls"]   # however the client re-dumped them


@pytest.mark.parametrize("arguments, match", [
    ('{"a": ', r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not JSON"),
    ("[1, 2]", r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object"),
    ("nope", r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not JSON"),
])
def test_prepare_refuses_bad_arguments(arguments, match):
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {**CALL, "function": {"name": "f", "arguments": arguments}}]}]
    with pytest.raises(ValueError, match=match):
        prepare_messages(msgs, "qwen3")


@pytest.mark.parametrize("message, match", [
    ({"role": "robot", "content": "x"}, r"messages\[0\]\.role"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, r"messages\[0\]\.content"),
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, r"messages\[0\]\.tool_calls"),
    ({"role": "assistant", "content": "x", "reasoning_content": 3}, r"messages\[0\]\.reasoning_content"),
    ({"role": "tool", "content": "x", "tool_call_id": 7}, r"messages\[0\]\.tool_call_id"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, r"tool_calls\[0\]\.function"),
])
def test_prepare_refuses_bad_messages(message, match):
    with pytest.raises(ValueError, match=match):
        prepare_messages([message], "qwen3")


def test_prepare_qwen3_5_literals_and_lfm2_calls():
    args = '{"s": "x", "t": true, "f": false, "n": null, "i": 3, "o": {"t": true, "n": null}, "l": [true]}'
    msg = [{"role": "assistant", "content": None,
            "tool_calls": [{**CALL, "function": {"name": "f", "arguments": args}}]}]
    q35 = prepare_messages(msg, "qwen3_5")[0]["tool_calls"][0]["function"]["arguments"]
    # top-level literals as JSON writes them; nested ones stay values (the template uses tojson)
    assert q35 == {"s": "x", "t": "true", "f": "false", "n": "null", "i": 3, "o": {"t": True, "n": None},
                   "l": [True]}
    assert prepare_messages(msg, "qwen3")[0]["tool_calls"][0]["function"]["arguments"]["t"] is True
    lfm = prepare_messages([{**msg[0], "content": "Sure."}], "lfm2")[0]
    assert lfm["content"] == ('<|tool_call_start|>[f(s="x", t=True, f=False, n=None, i=3, '
                              'o={"t": True, "n": None}, l=[True])]<|tool_call_end|>Sure.')


def test_prepare_developer_text_parts_and_family():
    out = prepare_messages([{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}], "qwen3")
    assert out == [{"role": "system", "content": "ab"}]
    with pytest.raises(ValueError, match="family must be one of"):
        prepare_messages([], "hermes")


# ---- template kwargs (reasoning effort) -------------------------------------------------------

def test_template_kwargs():
    assert template_kwargs(None) == {}
    assert template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    assert template_kwargs(None, "minimal") == {"enable_thinking": False, "reasoning_effort": "minimal"}
    assert template_kwargs({"enable_thinking": True, "x": 1}, "low") == \
        {"enable_thinking": True, "reasoning_effort": "low", "x": 1}
    for bad, match in [(({"enable_thinking": True}, "none"), "conflicts|turns thinking off"),
                       (({"enable_thinking": "no"}, None), "enable_thinking must be true or false"),
                       ((None, "max"), "reasoning_effort must be one of"),
                       (({"tools": []}, None), "may not set"),
                       (("x", None), "must be an object")]:
        with pytest.raises(ValueError, match=match):
            template_kwargs(*bad)


def test_render_refusals():
    plain = ChatTemplate.from_source(None)
    assert plain.render([{"role": "user", "content": "Hi"}]) == "user: Hi\nassistant: "
    with pytest.raises(ValueError, match="no chat template"):
        plain.render([{"role": "user", "content": "Hi"}], tools=[{"type": "function"}])
    tpl = ChatTemplate.from_source("{{ raise_exception('no ' + messages[0].role) }}")
    with pytest.raises(ValueError, match="chat template refused the messages: no user"):
        tpl.render([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="may not set"):
        tpl.render([], template_kwargs={"messages": []})


def test_environment_is_transformers():
    """Features the released templates do not use, rendered by transformers' own function."""
    from transformers.utils.chat_template_utils import render_jinja_template
    src = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
           "{% generation %}{{ m.content | tojson(indent=1) }}{% endgeneration %}{% set ns.n = ns.n + 1 %}"
           "{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson(sort_keys=True) }}{{ 'é' | tojson }}"
           "{{ (strftime_now('%Y') | length) }}{{ messages[0].thinking }}{{ bos_token }}")
    msgs = [{"role": "user", "content": "x", "reasoning": "r", "name": None}, {"role": "user", "content": [1]},
            {"role": "user", "content": "z"}]
    want = render_jinja_template([copy.deepcopy([{k: v for k, v in m.items() if v is not None} for m in msgs])],
                                 chat_template=src, bos_token="<s>")[0][0]
    assert ChatTemplate.from_source(src, {"bos_token": "<s>"}).render(msgs, add_generation_prompt=False) == want
    with pytest.raises(ValueError, match="underscore"):
        ChatTemplate.from_source("{% set ns = namespace(_x=1) %}").render([])


# ---- a three-step tool loop -------------------------------------------------------------------

def _xml_value(v):
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _py(v):
    if v is None or isinstance(v, bool):
        return str(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_py(x)}" for k, x in v.items()) + "}"
    return json.dumps(v, ensure_ascii=False)


def _written(family, name, args):
    """A call as the model writes it, in the released format of its family."""
    if family == "qwen3":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"
    if family == "qwen3_5":
        params = "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    return f"<|tool_call_start|>[{name}(" + ", ".join(f"{k}={_py(v)}" for k, v in args.items()) + \
        ")]<|tool_call_end|>"


CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}),
         ("search", {"query": "musées ouverts", "exact": True, "cursor": None, "limit": 2,
                     "filters": {"open": True, "price": None}})]
TOOLS = next(c["tools"] for c in json.loads((GOLDEN / "qwen3-0.6b.json").read_text())["cases"]
             if c["name"] == "tools_offered")
# (template, arch, template kwargs, reasoning: "open" = the model opens <think> itself,
#  "prefilled" = the generation prompt ends in <think>\n, None = no reasoning)
LOOPS = [("qwen3-0.6b.jinja", "qwen3", {}, "open"),
         ("qwen3_5-0.8b.jinja", "qwen3_5", {}, None),
         ("qwen3_5-0.8b.jinja", "qwen3_5", {"enable_thinking": True}, "prefilled"),
         ("qwen3_5.jinja", "qwen3_5", {}, "prefilled"),
         ("lfm2-350m.jinja", "lfm2", {}, None)]


def _loop(tmp_path, file, arch, kwargs, reasoning, keep_reasoning=True):
    """The prompts of a three-step loop, the text generated at each step, and the tokenizer.
    Clients send the arguments back re-serialized (compact) and content null."""
    write_chat_tokenizer(arch, tmp_path)
    from flashrt.models.tokenizer import load_tokenizer
    tok = load_tokenizer(tmp_path, 512)
    tpl = ChatTemplate.from_source((CHAT_TEMPLATES / file).read_text(encoding="utf-8"),
                                   CHAT_TOKENIZERS[arch][3])
    msgs = [{"role": "system", "content": "You plan trips."},
            {"role": "user", "content": "Weather in Paris, then museums open today?"}]
    prompts, generated = [], []
    for step in range(len(CALLS) + 1):
        prompts.append(tpl.render(prepare_messages(msgs, arch), tools=TOOLS, template_kwargs=kwargs))
        if step == len(CALLS):
            break
        name, args = CALLS[step]
        thought = f"Step {step}: call {name}."
        text = _written(arch, name, args)
        if reasoning == "open":
            text = f"<think>\n{thought}\n</think>\n\n" + text
        elif reasoning == "prefilled":
            text = f"{thought}\n</think>\n\n" + text
        generated.append(text)
        said = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{step}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, separators=(",", ":"))}}]}
        if reasoning and keep_reasoning:
            said["reasoning_content"] = thought
        msgs += [said, {"role": "tool", "tool_call_id": f"call_{step}", "content": f"result {step}"}]
    return tpl, tok, prompts, generated


@pytest.mark.parametrize("file, arch, kwargs, reasoning", LOOPS, ids=[f"{f}-{k}" for f, _, k, _ in LOOPS])
def test_tool_loop_is_prefix_stable(tmp_path, file, arch, kwargs, reasoning):
    tpl, tok, prompts, generated = _loop(tmp_path, file, arch, kwargs, reasoning)
    end = tok.encode("<|im_end|>")
    assert len(end) == 1
    for before, text, after in zip(prompts, generated, prompts[1:]):
        assert after.startswith(before + text + "<|im_end|>")
        ids = tok.encode(before) + tok.encode(text) + end        # what the session holds
        assert tok.encode(after)[:len(ids)] == ids


def _common(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("file, arch, kwargs, reasoning", [loop for loop in LOOPS if loop[3]],
                         ids=[f"{f}-{k}" for f, _, k, r in LOOPS if r])
def test_dropped_reasoning_diverges_at_the_previous_call(tmp_path, file, arch, kwargs, reasoning):
    """A client that drops reasoning_content (LangChain does) gets the previous assistant
    message rendered without its thought: the render diverges where the generated text began,
    so that message's call and the tool results are prefilled again; what came before is kept."""
    _, tok, prompts, generated = _loop(tmp_path, file, arch, kwargs, reasoning, keep_reasoning=False)
    for before, text, after in zip(prompts, generated, prompts[1:]):
        held, ids = tok.encode(before) + tok.encode(text), tok.encode(after)
        assert _common(held, ids) == len(tok.encode(before))       # tokens the session keeps
        # Qwen3 drops the think block of an earlier call; Qwen3.5 renders it empty
        redone = "<tool_call>" if reasoning == "open" else "\n</think>\n\n<tool_call>"
        assert after[len(before):].startswith(redone)


def test_qwen3_thinking_off_is_not_prefix_stable(tmp_path):
    """Qwen3's template writes the empty think block only in the generation prompt, never for an
    earlier assistant message: with thinking off each step diverges at the block before the call."""
    _, tok, prompts, generated = _loop(tmp_path, "qwen3-0.6b.jinja", "qwen3", {"enable_thinking": False}, None)
    empty = "<think>\n\n</think>\n\n"
    for before, text, after in zip(prompts, generated, prompts[1:]):
        assert before.endswith(empty)
        kept = before[:-len(empty)]
        assert _common(tok.encode(before) + tok.encode(text), tok.encode(after)) == len(tok.encode(kept))
        assert after[len(kept):].startswith("<tool_call>")


# ---- the chat tokenizer of random-weight checkpoints ------------------------------------------

@pytest.mark.parametrize("arch", sorted(CHAT_TOKENIZERS))
def test_chat_checkpoint(ckpt, arch):
    from safetensors.torch import load_file

    from flashrt.models.tokenizer import load_tokenizer
    path, bare = ckpt(arch, "tiny", chat=True), ckpt(arch, "tiny")
    a, b = load_file(path / "model.safetensors"), load_file(bare / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)      # same weights, bitwise
    assert not (bare / "tokenizer.json").exists()
    cfg = json.loads((path / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    tok = load_tokenizer(path, vocab)
    _, _, added, named, stops = CHAT_TOKENIZERS[arch]
    assert 256 + len(added) <= vocab
    for k, (text, _) in enumerate(added):
        assert tok.encode(text) == [256 + k]                               # one token each
    assert tok.encode("é<|im_end|>") == [0xC3, 0xA9, 256 + [t for t, _ in added].index("<|im_end|>")]
    tpl = ChatTemplate(path)
    assert tpl.special_tokens == named and tpl.kind == "checkpoint"
    prompt = tpl.render(prepare_messages([{"role": "user", "content": "Où?"}], arch), tools=TOOLS)
    assert tok.decode(tok.encode(prompt)) == prompt
    tok.decode([vocab - 1])                                                # past the tokenizer: no error
    gen = json.loads((path / "generation_config.json").read_text())
    assert [tok.decode([i]) for i in gen["eos_token_id"]] == list(stops)
    eos = cfg.get("text_config", cfg)["eos_token_id"]
    assert tok.decode([eos]) in ("<|endoftext|>", "<|im_end|>")
