"""How each model family writes reasoning and tool calls, and what a complete call's text means.

A `ChatFormat` names the tags; the functions below read one complete piece of call text (the
incremental work, holding text back until it is or is not a tag, lives in parser.py). Checked
against the released chat templates:

- Qwen3 (Hermes style): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, calls
  joined by `\\n`; the model opens `<think>` itself (`enable_thinking=False` prefills an empty
  block instead).
- Qwen3.5 (XML): `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n
  </tool_call>`. The template writes V with `tojson` for objects and arrays and `| string`
  otherwise, so a string is raw text and a boolean may come back as Python's `True`. Its
  generation prompt ends in `<think>\\n` when thinking is on.
- LFM2: `<|tool_call_start|>[f(a="x", b=1), g()]<|tool_call_end|>`, Python call syntax whose
  arguments are literals (LFM2.5's template quotes strings with `'`, writes mappings as JSON and
  other values with `| string`); `[{"name": ..., "arguments": {...}}]` is read as well.
"""
from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

SYNTAXES = ("hermes", "xml", "pythonic", "none")


@dataclass(frozen=True)
class ChatFormat:
    """name: the family; tool_syntax: how a call is written (one of SYNTAXES); call_tags: the
    (open, close) pair around calls; think: the (open, close) pair around reasoning, or None;
    think_in_prompt: the generation prompt itself opens the think block when thinking is on."""
    name: str
    tool_syntax: str
    call_tags: tuple[str, str] | None
    think: tuple[str, str] | None
    think_in_prompt: bool = False

    def __post_init__(self):
        if self.tool_syntax not in SYNTAXES:
            raise ValueError(f"ChatFormat {self.name!r}: tool_syntax {self.tool_syntax!r} is not one of "
                             f"{SYNTAXES}")
        if (self.call_tags is None) != (self.tool_syntax == "none"):
            raise ValueError(f"ChatFormat {self.name!r}: call_tags must be a pair exactly when "
                             f"tool_syntax is not 'none', got {self.call_tags!r}")
        for pair in (self.call_tags, self.think):
            if pair is not None and (len(pair) != 2 or not all(isinstance(t, str) and t for t in pair)):
                raise ValueError(f"ChatFormat {self.name!r}: a tag pair must be two non-empty strings, "
                                 f"got {pair!r}")
        if self.think_in_prompt and self.think is None:
            raise ValueError(f"ChatFormat {self.name!r}: think_in_prompt needs the think tags")


THINK = ("<think>", "</think>")
QWEN3 = ChatFormat("qwen3", "hermes", ("<tool_call>", "</tool_call>"), THINK)
QWEN3_5 = ChatFormat("qwen3_5", "xml", ("<tool_call>", "</tool_call>"), THINK, think_in_prompt=True)
LFM2 = ChatFormat("lfm2", "pythonic", ("<|tool_call_start|>", "<|tool_call_end|>"), THINK)
PLAIN = ChatFormat("plain", "none", None, None)
FORMATS = (QWEN3, QWEN3_5, LFM2, PLAIN)


def detect_format(template: str) -> ChatFormat:
    """The format a chat template's source writes: the family by its call marker, think tags
    when the template mentions `</think>`, and whether its generation prompt leaves a think
    block open (more `<think>` than `</think>` after the last `add_generation_prompt`)."""
    if not isinstance(template, str):
        raise TypeError(f"detect_format: expected the chat template's source text, got "
                        f"{type(template).__name__}")
    if "<function=" in template:
        family = QWEN3_5
    elif "<|tool_call_start|>" in template or "<|tool_list_start|>" in template:   # LFM2-350M: the latter only
        family = LFM2
    elif "<tool_call>" in template:
        family = QWEN3
    else:
        family = PLAIN
    if "</think>" not in template:
        return replace(family, think=None, think_in_prompt=False)
    at = template.rfind("add_generation_prompt")
    prompt = template[at:] if at >= 0 else ""
    return replace(family, think=THINK, think_in_prompt=prompt.count("<think>") > prompt.count("</think>"))


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def to_json(value: Any) -> str:
    """The one JSON spelling of arguments (`json.dumps` defaults, non-ASCII kept): a call's
    `arguments` string, and the pieces the XML parser streams, which concatenate to it. A lone
    surrogate (a JSON `\\ud800` escape) stays escaped, so the text still encodes as UTF-8."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return False, None


def hermes_call(text: str) -> list[tuple[str, dict]] | None:
    """`{"name": str, "arguments": {...}}` (nothing else) -> [(name, arguments)], or None."""
    ok, obj = _json(text)
    if not ok or not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return None
    if not isinstance(obj["name"], str) or not isinstance(obj["arguments"], dict):
        return None
    return [(obj["name"], obj["arguments"])]


_PY_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    """A JSON value from a literal expression; anything else (a call, a name, bytes, inf) raises."""
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (bool, int, float, str)):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        value = -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    elif isinstance(node, ast.Name) and node.id in _PY_NAMES:
        value = _PY_NAMES[node.id]
    elif isinstance(node, (ast.List, ast.Tuple)):
        value = [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
            raise ValueError("a mapping needs distinct string keys")
        value = {k: _literal(v) for k, v in zip(keys, node.values)}
    else:
        raise ValueError(f"not a literal: {type(node).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("a non-finite number is not JSON")
    return value


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError("a function name must be a dotted name")


def _one_call(node: ast.AST) -> tuple[str, dict]:
    if isinstance(node, ast.Call):
        names = [k.arg for k in node.keywords]
        if node.args or None in names or len(set(names)) != len(names):
            raise ValueError("only distinct keyword arguments")
        return _dotted(node.func), {k.arg: _literal(k.value) for k in node.keywords}
    obj = _literal(node)                                    # the JSON form {"name", "arguments"}
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} \
            or not isinstance(obj["name"], str) or not isinstance(obj["arguments"], dict):
        raise ValueError("an element must be a call or {name, arguments}")
    return obj["name"], obj["arguments"]


def pythonic_calls(text: str) -> list[tuple[str, dict]] | None:
    """`[f(a="x"), g(b=1)]` (or one bare call) -> [(name, arguments)], or None. Parsed with
    `ast`, never evaluated: arguments must be literals (True/None and true/null alike)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = [_one_call(n) for n in nodes]
    except (SyntaxError, ValueError, RecursionError):
        return None
    return calls or None


def _types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows (from type, anyOf/oneOf, or enum); empty = any."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    subs = [s for key in ("anyOf", "oneOf") for s in schema.get(key) or () if isinstance(s, dict)]
    if subs:
        found = [_types(s) for s in subs]
        return set().union(*found) if all(found) else set()
    if isinstance(schema.get("enum"), list):
        return {_type_of(v) for v in schema["enum"]}
    return set()


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", dict: "object", list: "array"}[type(value)]


def xml_value(raw: str, schema: Any) -> Any:
    """A Qwen3.5 parameter's text as the value its schema declares: a string stays raw; another
    declared type is parsed as JSON (Python's True/False/None too, as the template writes them)
    and kept if it is of that type, else the raw string. Undeclared: JSON objects and arrays
    are parsed, everything else stays a string."""
    types = _types(schema)
    if types == {"string"}:
        # an enum / const value with blanks around: the padding a tool grammar allows around
        # the value (xgrammar's XML tag), not part of it
        allowed = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if isinstance(allowed, list) and raw not in allowed and raw.strip() in allowed:
            return raw.strip()
        return raw
    ok, value = _json(raw)
    if not ok and raw.strip() in ("True", "False", "None"):
        ok, value = True, _PY_NAMES[raw.strip()]
    if not ok:
        return raw
    if not types:
        return value if isinstance(value, (dict, list)) else raw
    kind = _type_of(value)
    if kind in types or (kind == "integer" and "number" in types):
        return value
    if kind == "number" and "integer" in types and value.is_integer():
        return int(value)
    return raw
