"""The reply parser (flashrt/chat/parser.py) and the formats (flashrt/chat/formats.py).

Property tests (hypothesis, derandomized: the same examples on every run): replies are rendered
the way the released chat templates write them, from drawn reasoning, content and calls whose
arguments follow a tool's schema; the parse gives those parts back, any split of the text fed as
a stream folds to the same Reply, and every call's arguments are a JSON object valid for its
tool. A fuzz over tag fragments checks the same stream/whole agreement on text that is mostly
not well formed. Then examples: partial tags, calls inside reasoning, malformed calls, XML value
conversion, LFM2 literals, format detection and input checks."""
from __future__ import annotations

import itertools
import json
import re

import pytest

from flashrt.chat.formats import (LFM2, PLAIN, QWEN3, QWEN3_5, ChatFormat, detect_format, pythonic_calls,
                                  to_json, xml_value)
from flashrt.chat.parser import (Content, Reasoning, Reply, ReplyParser, ToolCall, ToolCallArguments,
                                 ToolCallEnd, ToolCallStart, new_call_id, parse_reply, tool_parameters)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=120,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer"}}, "required": ["city"], "additionalProperties": False},
    "search.web": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
        "cutoff": {"type": "number"}, "filters": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}}, "note": {"type": "null"}},
        "required": ["query"]},
    "ping": {"type": "object", "properties": {}},
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|tool_call_start|>", "<|tool_call_end|>")
XML_ENDS = ("</parameter>", "</function>")


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def validate(value, schema, path="$"):
    """A minimal JSON-schema check: type, enum, required, properties, additionalProperties, items."""
    kinds = {"null": lambda v: v is None, "boolean": lambda v: isinstance(v, bool),
             "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
             "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
             "string": lambda v: isinstance(v, str), "object": lambda v: isinstance(v, dict),
             "array": lambda v: isinstance(v, list)}
    if "type" in schema:
        assert kinds[schema["type"]](value), f"{path}: {value!r} is not {schema['type']}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        assert set(schema.get("required", ())) <= set(value), f"{path}: missing {schema.get('required')}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: unexpected keys {set(value) - set(props)}"
        for k, v in value.items():
            if k in props:
                validate(v, props[k], f"{path}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            validate(v, schema["items"], f"{path}[{i}]")


# ---- drawing replies ---------------------------------------------------------------------------
CHARS = st.sampled_from(list("ab z<>/|_=\n\t{}[]\"'\\:,") + ["think", "tool", "call", "<tool", "</th",
                                                            "<|tool_call", "é", "日本", "😀"])
TEXT = st.lists(CHARS, max_size=12).map("".join).filter(lambda t: not any(x in t for x in TAGS + XML_ENDS))
PART = TEXT.map(str.strip)                      # text next to a tag: its whitespace belongs to the tag
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                   st.floats(allow_nan=False, allow_infinity=False), TEXT)
JSONISH = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(PART, inner, max_size=3),
                       max_leaves=6)
BY_TYPE = {"string": TEXT, "integer": st.integers(-10**9, 10**9), "boolean": st.booleans(), "null": st.none(),
           "number": st.floats(allow_nan=False, allow_infinity=False),
           "object": st.dictionaries(PART, JSONISH, max_size=3), "array": st.lists(TEXT, max_size=3)}


@st.composite
def calls(draw, max_calls=3):
    out = []
    for _ in range(draw(st.integers(0, max_calls))):
        name = draw(st.sampled_from(sorted(SCHEMAS)))
        schema = SCHEMAS[name]
        args = {}
        for key, prop in schema["properties"].items():
            if key in schema.get("required", ()) or draw(st.booleans()):
                args[key] = draw(st.sampled_from(prop["enum"]) if "enum" in prop else BY_TYPE[prop["type"]])
        out.append((name, dict(draw(st.permutations(list(args.items()))))))
    return out


def _xml_value(v):
    """As the Qwen3.5 template writes a value: tojson for containers, `| string` otherwise."""
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else str(v)


def render(fmt, reasoning, content, drawn, tail, json_style=False):
    """A reply as the family's template writes the assistant turn (qwen3_5: after `<think>\\n`)."""
    if fmt is QWEN3:
        out = "" if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n"
        out += content
        for i, (name, args) in enumerate(drawn):
            out += ("\n" if i or content else "") + "<tool_call>\n" + json.dumps(
                {"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
    elif fmt is QWEN3_5:
        out = f"{reasoning or ''}\n</think>\n\n{content}"
        for i, (name, args) in enumerate(drawn):
            out += ("\n" if i else "\n\n" if content else "") + f"<tool_call>\n<function={name}>\n"
            out += "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in args.items())
            out += "</function>\n</tool_call>"
    else:
        lit = (lambda v: json.dumps(v, ensure_ascii=False)) if json_style else repr
        out = ("" if reasoning is None else f"<think>{reasoning}</think>") + content
        if drawn:
            written = [f"{n}(" + ", ".join(f"{k}={lit(v)}" for k, v in a.items()) + ")" for n, a in drawn]
            out += "<|tool_call_start|>[" + ", ".join(written) + "]<|tool_call_end|>"
    return out + tail


def stream(fmt, text, cuts, **kw):
    parser, bounds = ReplyParser(fmt, TOOLS, call_id=counter_ids(), **kw), [0, *sorted(cuts), len(text)]
    return [e for a, b in zip(bounds, bounds[1:]) for e in parser.feed(text[a:b])] + parser.finish()


def check_events(events):
    """Each call: one start, its pieces, one end, in order; pieces concatenate to a JSON object."""
    open_calls, pieces = set(), {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index not in pieces
            open_calls.add(e.index)
            pieces[e.index] = ""
        elif isinstance(e, ToolCallArguments):
            assert e.index in open_calls
            pieces[e.index] += e.fragment
        elif isinstance(e, ToolCallEnd):
            open_calls.remove(e.index)
            assert isinstance(json.loads(pieces[e.index]), dict)
    assert not open_calls


@pytest.mark.parametrize("fmt", [QWEN3, QWEN3_5, LFM2], ids=lambda f: f.name)
@SETTINGS
@given(data=st.data())
def test_stream_equals_whole_and_gives_the_parts_back(fmt, data):
    think = fmt is QWEN3_5 or data.draw(st.booleans())
    reasoning = data.draw(PART) if think else None
    content, drawn = data.draw(PART), data.draw(calls())
    tail = data.draw(PART) if fmt is LFM2 and drawn else ""      # LFM2 may write text after its calls
    text = render(fmt, reasoning, content, drawn, tail, json_style=data.draw(st.booleans()))
    whole = parse_reply(fmt, text, TOOLS, reasoning=True, call_id=counter_ids())
    expected = Reply(reasoning or "", content + tail,
                     tuple(ToolCall(f"call_{i}", n, to_json(a)) for i, (n, a) in enumerate(drawn)))
    assert whole == expected
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=16))
    events = stream(fmt, text, cuts, reasoning=True)
    check_events(events)
    assert Reply.fold(events) == whole
    assert not any(t in whole.content for t in TAGS) and "</think>" not in whole.reasoning
    for call in whole.tool_calls:
        validate(json.loads(call.arguments), SCHEMAS[call.name])


PIECES = st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=ping>",
                          "<function=get_weather>", "<function=nope>", "<parameter=city>", "<parameter=days>",
                          "</parameter>", "</function>", '{"name": "ping", "arguments": {}}',
                          '{"name": "get_weather", "arguments": {"city": 1}', "<|tool_call_start|>",
                          "[ping()]", "[get_weather(city='x'), ping()]", "[nope(a=1)]", "<|tool_call_end|>",
                          "<", "</", "<tool", "<|", "\n", " ", "x", "7", "{", "[", "Tr", "ue"])
UNITS = ['<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\n<parameter=days>\n"
         "7\n</parameter>\n</function>\n</tool_call>", "<tool_call>\n<function=ping>\n</function>\n</tool_call>",
         "<|tool_call_start|>[ping(), get_weather(city='x', days=7)]<|tool_call_end|>", "<think>\nhm\n</think>\n\n"]
# whole units, their beginnings (a reply cut anywhere), and single pieces, in any order
FUZZ = st.one_of(PIECES, st.sampled_from(UNITS),
                 st.sampled_from(UNITS).flatmap(lambda u: st.integers(0, len(u)).map(lambda k: u[:k])))


@pytest.mark.parametrize("fmt", [QWEN3, QWEN3_5, LFM2, PLAIN], ids=lambda f: f.name)
@SETTINGS
@given(data=st.data())
def test_fuzz_any_split_of_any_text_folds_the_same(fmt, data):
    text = "".join(data.draw(st.lists(FUZZ, max_size=16)))
    reasoning = data.draw(st.booleans())
    whole = parse_reply(fmt, text, TOOLS, reasoning=reasoning, call_id=counter_ids())
    events = stream(fmt, text, data.draw(st.lists(st.integers(0, len(text)), max_size=16)), reasoning=reasoning)
    check_events(events)
    assert Reply.fold(events) == whole
    assert all(c.name in SCHEMAS and isinstance(json.loads(c.arguments), dict) for c in whole.tool_calls)


# ---- examples ----------------------------------------------------------------------------------
def test_partial_tags_are_held_then_released_as_text():
    p = ReplyParser(QWEN3, TOOLS)
    assert p.feed("Hello <tool") == [Content("Hello")]           # " <tool" may still become a tag
    assert p.feed("s are fine <thi") == [Content(" <tools are fine")]
    assert p.feed("ng>") == [Content(" <thing>")]
    assert p.feed(" and <|tool_call_start|> ") == [Content(" and <|tool_call_start|>")]  # not a Qwen3 tag
    assert p.feed("<tool_cal") == []
    assert p.finish() == [Content(" <tool_cal")]                   # the end: what was held is text


def test_a_call_inside_reasoning_stays_reasoning():
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    r = parse_reply(QWEN3, f"<think>\nmaybe {call}\n</think>\n\nno call", TOOLS)
    assert r == Reply(f"maybe {call}", "no call", ())
    r = parse_reply(QWEN3_5, "I could <tool_call>\n<function=ping>\n</function>\n</tool_call></think>ok",
                    TOOLS, reasoning=True)
    assert r.tool_calls == () and r.reasoning.startswith("I could <tool_call>") and r.content == "ok"


def test_parallel_calls_get_indices_and_injected_ids_in_order():
    text = ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    p = ReplyParser(QWEN3, TOOLS, call_id=iter(["call_a", "call_b"]).__next__)
    events = p.feed(text) + p.finish()
    assert [e for e in events if isinstance(e, ToolCallStart)] == [ToolCallStart(0, "call_a", "ping"),
                                                                   ToolCallStart(1, "call_b", "get_weather")]
    assert Reply.fold(events).tool_calls[1] == ToolCall("call_b", "get_weather", '{"city": "Oslo"}')
    r = parse_reply(LFM2, "<|tool_call_start|>[ping(), search.web(query='q')]<|tool_call_end|>", TOOLS)
    assert [c.name for c in r.tool_calls] == ["ping", "search.web"]


@pytest.mark.parametrize("fmt, text", [
    (QWEN3, 'Sure.\n<tool_call>\n{"name": "ping", "arguments": {}\n</tool_call>'),            # bad JSON
    (QWEN3, '<tool_call>\n{"name": "ping"}\n</tool_call>'),                                   # no arguments
    (QWEN3, '<tool_call>\n{"name": "ping", "arguments": [1]}\n</tool_call>'),                 # not an object
    (QWEN3, '<tool_call>\n{"name": "ping", "arguments": {"x": NaN}}\n</tool_call>'),          # not JSON
    (QWEN3, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),                 # not offered
    (QWEN3, 'see <tool_call> tags'),                                                          # prose
    (QWEN3, '<tool_call>\n{"name": "ping", "arguments": {}}'),                                # unterminated
    (QWEN3_5, 'x <tool_call>\n<function=rm_rf>\n</function>\n</tool_call>'),                  # not offered
    (QWEN3_5, '<tool_call>\n<function=ping'),                                                 # unterminated
    (QWEN3_5, '<tool_call>\n<function=a b>\n</function>\n</tool_call>'),                      # bad name
    (LFM2, '<|tool_call_start|>[ping(1)]<|tool_call_end|>'),                                  # positional
    (LFM2, '<|tool_call_start|>[ping(a=open("f"))]<|tool_call_end|>'),                        # not a literal
    (LFM2, '<|tool_call_start|>[ping(]<|tool_call_end|>'),                                    # syntax
    (LFM2, '<|tool_call_start|>[ping()]'),                                                    # unterminated
])
def test_malformed_call_text_comes_back_verbatim_as_content(fmt, text):
    r = parse_reply(fmt, text, TOOLS)
    assert r == Reply("", text, ())
    for cut in range(len(text) + 1):
        assert Reply.fold(stream(fmt, text, [cut])) == Reply("", text, ())


def test_xml_arguments_stream_as_each_parameter_completes():
    p = ReplyParser(QWEN3_5, TOOLS, call_id=lambda: "call_x")
    assert p.feed("<tool_call>\n<function=get_weather>\n") == [ToolCallStart(0, "call_x", "get_weather")]
    assert p.feed("<parameter=city>\nSão Paulo\n</param") == []
    assert p.feed("eter>\n<parameter=days>\n") == [ToolCallArguments(0, '{"city": "São Paulo"')]
    assert p.feed("3\n</parameter>\n</function>") == [ToolCallArguments(0, ', "days": 3')]
    assert p.feed("\n</tool_call>") == [ToolCallArguments(0, "}"), ToolCallEnd(0)]
    assert p.finish() == []


def test_xml_call_unclosed_at_finish_keeps_completed_parameters():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n4"
    assert parse_reply(QWEN3_5, text, TOOLS, call_id=lambda: "c").tool_calls == (
        ToolCall("c", "get_weather", '{"city": "Rome"}'),)


@pytest.mark.parametrize("text, arguments, content", [
    ("<tool_call>\n<function=ping>\n</function>\nafter", "{}", "after"),                # no close tag
    ("<tool_call>\n<function=get_weather>\njunk<parameter=city>\nA\n</parameter>\n</tool_call>",
     '{"city": "A"}', ""),                                                       # stray text, no </function>
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</function>\n</tool_call> b",
     '{"city": "A"}', "b"),                                                              # no </parameter>
])
def test_xml_calls_missing_a_tag_end_the_same_for_every_split(text, arguments, content):
    whole = parse_reply(QWEN3_5, text, TOOLS, call_id=lambda: "c")
    assert whole.tool_calls[0].arguments == arguments and whole.content == content
    for cut in range(len(text) + 1):
        assert Reply.fold(stream(QWEN3_5, text, [cut])) == Reply.fold(stream(QWEN3_5, text, range(len(text))))


def test_xml_format_reads_hermes_json_and_repeated_parameters_keep_the_first():
    r = parse_reply(QWEN3_5, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', TOOLS)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("ping", "{}")]
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
            "<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>")
    assert parse_reply(QWEN3_5, text, TOOLS).tool_calls[0].arguments == '{"city": "A"}'


@pytest.mark.parametrize("schema, raw, value", [
    ({"type": "string"}, "42", "42"), ({"type": "string"}, " a\nb ", " a\nb "),
    ({"type": "integer"}, "42", 42), ({"type": "integer"}, "4.0", 4), ({"type": "integer"}, "four", "four"),
    ({"type": "number"}, "1e-07", 1e-07), ({"type": "number"}, "7", 7), ({"type": "boolean"}, "true", True),
    ({"type": "boolean"}, "False", False), ({"type": "boolean"}, "yes", "yes"), ({"type": "null"}, "None", None),
    ({"type": "object"}, '{"a": [1]}', {"a": [1]}), ({"type": "object"}, "{a}", "{a}"),
    ({"type": "array"}, "[1, 2]", [1, 2]), ({"type": "array"}, '{"a": 1}', '{"a": 1}'),
    ({"type": ["string", "null"]}, "null", None), ({"type": ["integer", "string"]}, "x", "x"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "5", 5), ({"enum": [1, 2]}, "2", 2),
    ({}, "[1]", [1]), ({}, "5", "5"), (None, "true", "true"), ({"type": "number"}, "NaN", "NaN"),
    # a tool grammar's padding around an enum / const string is not the value; a member with blanks is kept
    ({"type": "string", "enum": ["red", "blue"]}, " \n\nred\t", "red"), ({"enum": ["a", " b"]}, " b", " b"),
    ({"type": "string", "const": "x"}, "\r x ", "x"), ({"type": "string", "enum": ["red"]}, " rad ", " rad "),
])
def test_xml_parameter_values_follow_the_schema_type(schema, raw, value):
    got = xml_value(raw, schema)
    assert got == value and type(got) is type(value)


def test_lfm2_literals():
    ok = pythonic_calls("[f(a='x', b=-1, c=2.5, d=True, e=None, f=[1, (2, 3)], g={'k': false}, h=null)]")
    assert ok == [("f", {"a": "x", "b": -1, "c": 2.5, "d": True, "e": None, "f": [1, [2, 3]],
                         "g": {"k": False}, "h": None})]
    assert pythonic_calls('[{"name": "f", "arguments": {"a": true}}, g()]') == [("f", {"a": True}), ("g", {})]
    assert pythonic_calls("a.b(x=1)") == [("a.b", {"x": 1})]
    for bad in ["[f(x=y)]", "[f(x=1+2)]", "[f(x=b'1')]", "[f(x=1e999)]", "[f(x=1j)]", "[f(**k)]",
                "[f(x=lambda: 1)]", "[f(x=f'{y}')]", "[f(x={1: 2})]", "[f(x={'a': 1, 'a': 2})]", "[1]",
                "[f(x=1, x=2)]", "[f()(x=1)]", "[]", "[f(x=[" * 300 + "]" * 300 + ")]"]:
        assert pythonic_calls(bad) is None, bad


def test_think_tags_and_whitespace():
    # Qwen3.5 with thinking off starts in content; a stray close tag is dropped
    assert parse_reply(QWEN3_5, "\nhi", TOOLS) == Reply("", "\nhi", ())
    assert parse_reply(QWEN3_5, "a\n</think>\n\nb", TOOLS) == Reply("", "ab", ())
    # Qwen3 opens its own block; text around it keeps inner whitespace, loses the tag's
    assert parse_reply(QWEN3, "<think>\n\n a b \n</think>\n\n c\n", TOOLS) == Reply("a b", "c\n", ())
    assert parse_reply(QWEN3_5, "thinking", TOOLS, reasoning=True) == Reply("thinking", "", ())
    plain = "<think>x</think> <tool_call>"
    assert parse_reply(PLAIN, plain, TOOLS) == Reply("", plain, ())


def test_lone_surrogate_in_arguments_stays_encodable():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud800x"}}\n</tool_call>'
    call = parse_reply(QWEN3, text, TOOLS).tool_calls[0]
    call.arguments.encode("utf-8")
    assert json.loads(call.arguments) == {"city": "\ud800x"}


QWEN3_5_GEN = ("{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking "
               "is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n    "
               "{%- else %}\n        {{- '<think>\\n' }}\n    {%- endif %}\n{%- endif %}")
QWEN3_GEN = ("{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking "
             "is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n    "
             "{%- endif %}\n{%- endif %}")


def test_detect_format_from_template_source():
    qwen3_5 = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}" + QWEN3_5_GEN
    assert detect_format(qwen3_5) == QWEN3_5
    qwen3 = "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>" + QWEN3_GEN
    assert detect_format(qwen3) == QWEN3
    lfm2 = '{{- "<|tool_call_start|>[" + (calls | join(", ")) + "]<|tool_call_end|>" -}}'
    assert detect_format(lfm2) == ChatFormat("lfm2", "pythonic", LFM2.call_tags, None)
    assert detect_format(lfm2 + '{{- "<think>" + message.thinking + "</think>" -}}') == LFM2
    assert detect_format("{{ messages[0]['content'] }}") == PLAIN
    assert detect_format("<tool_call>") == ChatFormat("qwen3", "hermes", QWEN3.call_tags, None)
    with pytest.raises(TypeError, match="template"):
        detect_format(None)


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="tool_syntax"):
        ChatFormat("x", "yaml", ("<a>", "</a>"), None)
    with pytest.raises(ValueError, match="think_in_prompt"):
        ChatFormat("x", "none", None, None, think_in_prompt=True)
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        tool_parameters([{"type": "function", "name": "f"}])
    with pytest.raises(ValueError, match=r"tools\[1\].function.name.*twice"):
        tool_parameters(TOOLS[:1] * 2)
    with pytest.raises(ValueError, match="function.name"):
        tool_parameters([{"type": "function", "function": {"name": "a b"}}])
    with pytest.raises(TypeError, match="tools"):
        ReplyParser(QWEN3, tools={"ping": {}})
    p = ReplyParser(QWEN3)
    p.finish()
    with pytest.raises(RuntimeError, match="finished"):
        p.feed("x")


def test_without_tools_any_valid_name_is_a_call_and_ids_are_random():
    r = parse_reply(QWEN3, '<tool_call>\n{"name": "anything", "arguments": {"a": 1}}\n</tool_call>')
    assert r.tool_calls[0].name == "anything"
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", r.tool_calls[0].id)
    assert len({new_call_id() for _ in range(100)}) == 100
    assert parse_reply(QWEN3, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', tools=[]) == \
        Reply("", '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', ())


def test_fold_is_the_events_in_order():
    events = [Reasoning("r"), Content("a"), ToolCallStart(0, "i", "ping"), ToolCallArguments(0, "{"),
              ToolCallArguments(0, "}"), ToolCallEnd(0), Content("b")]
    assert Reply.fold(events) == Reply("r", "ab", (ToolCall("i", "ping", "{}"),))
    with pytest.raises(ValueError, match="index 1"):
        Reply.fold([ToolCallStart(1, "i", "ping")])
