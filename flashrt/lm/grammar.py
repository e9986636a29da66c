"""Constrained decoding (xgrammar), with the grammar's state part of a session's execution state.

    g = lm.Grammar.json_schema({"type": "object", "properties": {...}}, strict=True)
    rt.generate(prompt, max_new_tokens=64, grammar=g)   # valid JSON, or finish_reason "length"

Grammar (a spec by value; key: sha256 of its canonical JSON, what capsules and caches name),
GrammarOptions (bounds), Grammars (a model's vocabulary and compiled grammars by key),
Constraint (a session's state: the matcher and the ids accepted since `start`), DraftMasks (a
speculative round's masks). LanguageModel keeps the constraint where the model state is: each
committed token is accepted (generate, decode, a speculative round); rollback undoes as many
(below `start` it ends); fork forks the matcher; snapshot puts its record (key, spec, start,
ids) in meta.extra["grammar"] and restore rebuilds the matcher by replaying the ids on first use
(matchers cannot be serialized); prefill, set_context and reset end it (the context is the
caller's; decode() forces a token under it). Sampling masks a copy of the last logits (refused
ids -> -inf; the arena keeps the raw ones) and draws with the sampler from the session's RNG,
so capsules stay deterministic. Its stop tokens are the model's EOS ids, allowed only once the
grammar is complete: under a grammar they end generation even with ignore_eos.

CUDA graphs: while a grammar is active generate() does not replay the fused "decode" body (step
+ on-device draw): it replays the per-size step graph, fills the bitmask on the host (the
matcher needs each token id there anyway: one sync per token), copies it to the device, masks
a copy of meta.logits with torch ops outside the graph and draws with `sample`. Speculative
verify and draft graphs replay unchanged; their cloned outputs are masked outside. Tested on
CPU; the CUDA path is the same code on device tensors, untested on a GPU.
xgrammar is imported when first needed: pip install 'flashrt[agents]'.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .schema import check_schema

REASONING = ("disabled", "enabled", "auto")
THINK = ("<think>", "</think>")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# xgrammar 0.2.9 prints a JSON string's characters as these classes, which admit UTF-16
# surrogates and (bounded length) raw control characters, neither valid JSON text: rebuilt with
# both excluded
_LOOSE_CHARS = ('[^\\0-\\x1f\\"\\\\\\r\\n]', '[^\\"\\\\\\r\\n]')
_JSON_CHARS = '[^\\"\\\\\\0-\\x1f\\ud800-\\udfff]'


def _xgr():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError("constrained decoding needs xgrammar: pip install 'flashrt[agents]' "
                          "(xgrammar==0.2.9)") from e
    return xgrammar


def _canonical(obj) -> str:
    """Compact JSON in the given key order (a schema's property order is its output order)."""
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"grammar spec is not JSON-serializable: {e}") from None


@dataclass(frozen=True)
class Grammar:
    """A grammar spec by value. kind: "json_schema", "json_object" or "tool_calls"; spec: the
    canonical JSON of its arguments; key: sha256 of both (what a capsule and a cache name)."""
    kind: str
    spec: str
    key: str = field(init=False)

    def __post_init__(self):
        if self.kind not in ("json_schema", "json_object", "tool_calls"):
            raise ValueError(f"grammar kind {self.kind!r}: use json_schema, json_object or tool_calls")
        digest = hashlib.sha256(f"{self.kind}\n{self.spec}".encode()).hexdigest()
        object.__setattr__(self, "key", digest)

    @staticmethod
    def json_schema(schema, strict: bool = True, reasoning: str = "disabled",
                    max_whitespace: int | None = None) -> "Grammar":
        """JSON matching `schema` (a dict, or its JSON text). strict: no properties or items
        the schema does not name (OpenAI's strict); strict=False allows extra ones.
        reasoning: "enabled" (the prompt ends in <think>: the think block's rest comes first),
        "auto" (an optional <think>...</think> block first) or "disabled"."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json schema must be an object, got {type(schema).__name__}")
        check_schema(schema)
        return Grammar._make("json_schema", {"schema": schema, "strict": _flag(strict, "strict")},
                             reasoning, max_whitespace)

    @staticmethod
    def json_object(reasoning: str = "disabled", max_whitespace: int | None = None) -> "Grammar":
        """Any JSON object (OpenAI's response_format json_object)."""
        return Grammar._make("json_object", {}, reasoning, max_whitespace)

    @staticmethod
    def tool_calls(tools, choice="required", parallel: bool = True, fmt: str = "qwen_3",
                   reasoning: str = "disabled", max_whitespace: int | None = None) -> "Grammar":
        """Tool calls in a model's format (xgrammar's built-in structural tags, e.g. "qwen_3",
        "qwen_3_5"). tools: OpenAI's [{"type": "function", "function": {name, parameters,
        strict}}]; choice: "auto", "required", "none" or {"type": "function", "function":
        {"name": ...}}; parallel=False: at most one call (exactly one unless "auto")."""
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be a list of objects {type: function, function: {...}}")
        names = []
        for i, t in enumerate(tools):
            fn = t.get("function")
            if t.get("type") != "function" or not isinstance(fn, dict):
                raise ValueError(f"tools[{i}]: expected {{type: 'function', function: {{...}}}}")
            name = fn.get("name")
            if not isinstance(name, str) or not _TOOL_NAME.match(name):
                raise ValueError(f"tools[{i}].function.name {name!r}: expected "
                                 "^[A-Za-z0-9_.-]{1,64}$")
            if name in names:
                raise ValueError(f"tools[{i}].function.name {name!r} is not unique")
            names.append(name)
            params = fn.get("parameters")
            if params is not None and fn.get("strict") is not False:
                check_schema(params, f"tools[{i}].function.parameters")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if choice.get("type") != "function" or name not in names:
                raise ValueError(f"tool_choice {choice!r}: names no tool in tools ({names})")
        elif choice not in ("auto", "required", "none"):
            raise ValueError(f"tool_choice {choice!r}: use auto, required, none or "
                             "{type: function, function: {name}}")
        if choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs at least one tool")
        return Grammar._make("tool_calls", {"tools": tools, "choice": choice, "format": fmt,
                                            "parallel": _flag(parallel, "parallel")},
                             reasoning, max_whitespace)

    @staticmethod
    def _make(kind, spec, reasoning, max_whitespace) -> "Grammar":
        if reasoning not in REASONING:
            raise ValueError(f"reasoning {reasoning!r}: use one of {REASONING}")
        if max_whitespace is not None and (isinstance(max_whitespace, bool) or
                                           not isinstance(max_whitespace, int) or max_whitespace < 1):
            raise ValueError(f"max_whitespace must be None or an int >= 1, got {max_whitespace!r}")
        spec = {**spec, "reasoning": reasoning, "max_whitespace": max_whitespace}
        return Grammar(kind, _canonical(spec))

    @staticmethod
    def from_record(rec) -> "Grammar":
        """The grammar of a Constraint.record() (a capsule's meta.extra["grammar"]); its key
        must be the one the record names."""
        if not isinstance(rec, dict) or not isinstance(rec.get("spec"), str):
            raise ValueError(f"grammar record must be {{kind, spec, key, ...}}, got {rec!r:.200}")
        g = Grammar(rec.get("kind"), rec["spec"])
        if g.key != rec.get("key"):
            raise ValueError(f"grammar record: key {rec.get('key')!r} is not the spec's ({g.key})")
        return g

    def build(self):
        """The xgrammar Grammar (vocabulary-free); ValueError naming what xgrammar refused."""
        xgr, a = _xgr(), json.loads(self.spec)
        ws = a["max_whitespace"]
        schema, strict = ((a["schema"], a["strict"]) if self.kind == "json_schema"
                          else ({"type": "object"}, False))
        fns = [t["function"] for t in a.get("tools", ())]
        schemas = [(f"tools.{f['name']}", f.get("parameters", True)) for f in fns
                   if f.get("strict") is not False] if fns else [("#", schema)]
        for where, pattern in (p for at, sch in schemas for p in check_schema(sch, at)):
            try:                # a regex xgrammar cannot take, named before it fails opaquely
                xgr.Grammar.from_regex(pattern)
            except (RuntimeError, ValueError) as e:
                raise ValueError(f"json schema keyword 'pattern' at {where}: {pattern!r} is not "
                                 f"supported: {e}") from None
        try:
            if self.kind == "tool_calls":
                tag = xgr.get_model_structural_tag(
                    a["format"], tools=a["tools"], tool_choice=a["choice"], reasoning=a["reasoning"],
                    parallel_tool_calls=a["parallel"], max_whitespace_cnt=ws)
                g = xgr.Grammar.from_structural_tag(tag)
            else:
                g = xgr.Grammar.from_json_schema(_canonical(schema), strict_mode=strict,
                                                 max_whitespace_cnt=ws)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{self.kind} grammar: xgrammar cannot build it: {e}") from None
        g = _json_strings(xgr, g)
        if self.kind == "tool_calls" or a["reasoning"] == "disabled":
            return g
        return xgr.Grammar.concat(_think(xgr, a["reasoning"]), g)


def _flag(v, name) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be true or false, got {v!r}")
    return v


def _json_strings(xgr, g):
    """g with its JSON string characters limited to what JSON text allows (_LOOSE_CHARS)."""
    text = fixed = str(g)
    for loose in _LOOSE_CHARS:
        fixed = fixed.replace(loose, _JSON_CHARS)
    try:
        return g if fixed == text else xgr.Grammar.from_ebnf(fixed)
    except (RuntimeError, ValueError):      # a grammar its printer cannot round-trip: as built
        return g


def _think(xgr, mode):
    """A leading reasoning block, as xgrammar's built-in Qwen tags write it."""
    from xgrammar import structural_tag as st
    block = st.SequenceFormat(elements=[
        st.TagFormat(begin="" if mode == "enabled" else THINK[0],
                     content=st.AnyTextFormat(excludes=list(THINK)), end=THINK[1]),
        st.ConstStringFormat(value="\n\n")])
    fmt = block if mode == "enabled" else st.OptionalFormat(content=block)
    return xgr.Grammar.from_structural_tag(st.StructuralTag(format=fmt))


@dataclass
class GrammarOptions:
    """Bounds of constrained decoding (LanguageModel Options.grammar). A grammar past one is
    refused with a ValueError naming it, and a refused key stays refused (it is not retried)."""
    max_spec_bytes: int = 256 << 10      # the canonical spec (schema, tools)
    max_grammar_bytes: int = 1 << 20     # the grammar xgrammar builds from it, as EBNF text
    max_compile_s: float = 10.0          # compiling against the vocabulary
    cache_size: int = 64                 # compiled grammars kept per model (least recent out)
    compile_threads: int = 2             # xgrammar's threads for one compile

    def __post_init__(self):
        for name, v in vars(self).items():
            kind = float if name == "max_compile_s" else int
            if isinstance(v, bool) or not isinstance(v, (int, kind)) or not v > 0:
                raise ValueError(f"GrammarOptions.{name} must be a positive {kind.__name__}, got {v!r}")


def vocabulary(model):
    """xgrammar's TokenizerInfo for a LoadedModel: its tokenizer.json's vocabulary (the
    `tokenizers` library), or flashrt's byte-level tokenizer (ids 0..255 are bytes); ids past
    the tokenizer up to the model's vocab size, and special added tokens, are never text."""
    xgr = _xgr()
    V = model.net.vocab_size
    stop = [i for i in model.eos_ids if 0 <= i < V] or None
    if getattr(model.tokenizer, "kind", None) == "bytes":
        vocab = [bytes([i]) for i in range(256)] + [b""] * (V - 256)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=stop)
    path = model.path / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"constrained decoding needs the checkpoint's tokenizer.json ({path} is "
                         "missing)")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path))
    vocab, added = [""] * V, tok.get_added_tokens_decoder()
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        if i < V:                       # a special token (<|im_end|>) is never text
            vocab[i] = "" if i in added and added[i].special else piece
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=V, stop_token_ids=stop,
                             add_prefix_space=meta["add_prefix_space"])


class Grammars:
    """One model's vocabulary and its compiled grammars by key (least recently used out past
    options.cache_size); the sessions of a model and their forks share one. Thread-safe."""

    def __init__(self, model, options: GrammarOptions | None = None):
        self.model, self.options = model, options or GrammarOptions()
        self.vocab_size = model.net.vocab_size
        self.stop_ids = tuple(i for i in model.eos_ids if 0 <= i < self.vocab_size)
        self._lock = threading.Lock()
        self._compiler = None
        self._compiled: OrderedDict = OrderedDict()
        self._refused: OrderedDict = OrderedDict()      # key -> why, bounded like the cache

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:      # xgrammar's own cache off: ours is bounded, by key
                self._compiler = _xgr().GrammarCompiler(
                    vocabulary(self.model), max_threads=self.options.compile_threads,
                    cache_enabled=False)
            return self._compiler

    def compile(self, grammar: Grammar):
        """The xgrammar CompiledGrammar of `grammar` (cached); ValueError when it is refused."""
        if not isinstance(grammar, Grammar):
            raise TypeError(f"grammar must be a flashrt.lm.Grammar, got {type(grammar).__name__}")
        key = grammar.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            why = self._refused.get(key)
        if why is not None:
            raise ValueError(why)
        try:
            compiled = self._compile(grammar)
        except ValueError as e:
            self._remember(self._refused, key, str(e))
            raise
        self._remember(self._compiled, key, compiled)
        return compiled

    def _remember(self, table: OrderedDict, key, value) -> None:
        with self._lock:
            table[key] = value
            while len(table) > self.options.cache_size:
                table.popitem(last=False)

    def _compile(self, grammar: Grammar):
        o, what = self.options, f"{grammar.kind} grammar {grammar.key[:12]}"
        if len(grammar.spec.encode()) > o.max_spec_bytes:
            raise ValueError(f"{what}: its spec is {len(grammar.spec.encode())} bytes, over "
                             f"GrammarOptions.max_spec_bytes={o.max_spec_bytes}")
        built = grammar.build()
        size = len(str(built).encode())
        if size > o.max_grammar_bytes:
            raise ValueError(f"{what}: the grammar is {size} bytes of EBNF, over "
                             f"GrammarOptions.max_grammar_bytes={o.max_grammar_bytes}")
        compiler, box = self._get_compiler(), {}

        def run():
            try:
                box["out"] = compiler.compile_grammar(built)
            except Exception as e:                      # noqa: BLE001 (handed to the caller)
                box["err"] = e
        # a thread, so a runaway compile is refused on time (it finishes in the background)
        t0 = time.monotonic()
        worker = threading.Thread(target=run, name="flashrt-grammar-compile", daemon=True)
        worker.start()
        worker.join(o.max_compile_s)
        took = time.monotonic() - t0
        if worker.is_alive() or took > o.max_compile_s:
            raise ValueError(f"{what}: compiling took over GrammarOptions.max_compile_s="
                             f"{o.max_compile_s}s ({took:.3g}s)")
        if "err" in box:
            raise ValueError(f"{what}: xgrammar could not compile it: {box['err']}") from None
        return box["out"]


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """(rows, ceil(vocab / 32)) int32 on the host, every id allowed: bit j of word i is id 32i+j."""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set refused ids of logits (T, V) to -inf in place, row t by bitmask[t] (host int32)."""
    xgr = _xgr()
    V = logits.shape[-1]
    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=V)
    else:   # torch ops: no triton or JIT kernel needed on the device
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=V, backend="torch_native")
    return logits


class Constraint:
    """One session's grammar state: `ids` are the tokens accepted since position `start` (read
    them, never change them). Built by LanguageModel.constrain / generate(grammar=); restored
    from a record, the matcher is rebuilt by replaying `ids` when first needed."""

    def __init__(self, grammar: Grammar, grammars: Grammars, start: int, ids=()):
        self.grammar, self.grammars, self.start = grammar, grammars, start
        self.ids = list(ids)
        self._matcher = self._row = None        # built on first use

    def matcher(self):
        """The xgrammar GrammarMatcher, built (and the ids replayed) on first use."""
        if self._matcher is None:
            xgr, g = _xgr(), self.grammars
            m = xgr.GrammarMatcher(g.compile(self.grammar), terminate_without_stop_token=not g.stop_ids)
            for i, t in enumerate(self.ids):
                if not m.accept_token(t):
                    raise ValueError(f"grammar {self.grammar.key[:12]}: token {t} at position "
                                     f"{self.start + i} does not replay (not a state it made)")
            self._matcher = m
        return self._matcher

    @staticmethod
    def from_record(rec, grammars: Grammars, position: int) -> "Constraint":
        """A constraint from record() (a capsule's meta.extra["grammar"]) of a state at
        `position`: checked now, its matcher replayed when first used."""
        g = Grammar.from_record(rec)
        start, ids = rec.get("start"), rec.get("ids")
        if not isinstance(start, int) or not isinstance(ids, list) or start + len(ids) != position \
                or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"grammar record: start {start!r} + {len(ids or [])} ids is not the "
                             f"capsule's position {position}")
        return Constraint(g, grammars, start, ids)

    def record(self) -> dict:
        return {"kind": self.grammar.kind, "spec": self.grammar.spec, "key": self.grammar.key,
                "start": self.start, "ids": list(self.ids)}

    def fork(self) -> "Constraint":
        """An independent copy (xgrammar's fork: no replay)."""
        c = Constraint(self.grammar, self.grammars, self.start, self.ids)
        c._matcher = None if self._matcher is None else self._matcher.fork()
        return c

    @property
    def terminated(self) -> bool:
        """It accepted a stop token (or, without stop tokens, its grammar is complete)."""
        return self.matcher().is_terminated()

    def accept(self, token: int) -> bool:
        """Accept a token; False (state unchanged) when the grammar refuses it."""
        if not self.matcher().accept_token(int(token)):
            return False
        self.ids.append(int(token))
        return True

    def require(self, token: int) -> None:
        """Accept a token chosen under this grammar's mask (RuntimeError if it refuses it)."""
        if not self.accept(token):
            raise RuntimeError(f"token {token} is outside grammar {self.grammar.key[:12]}'s mask "
                               "(it was not chosen under it)")

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        if not 0 <= n <= len(self.ids):
            raise ValueError(f"grammar rollback by {n}: it holds {len(self.ids)} tokens")
        if n:
            self.matcher().rollback(n)
            del self.ids[len(self.ids) - n:]

    def fill(self, bitmask: torch.Tensor, row: int = 0) -> bool:
        """bitmask[row] := the ids allowed next; False (row untouched) once terminated."""
        m = self.matcher()
        if m.is_terminated():
            return False
        m.fill_next_token_bitmask(bitmask, row)
        return True

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask logits (V,) in place to the ids allowed next; returns them."""
        if self._row is None:
            self._row = new_bitmask(1, self.grammars.vocab_size)
        if not self.fill(self._row):
            raise RuntimeError(f"grammar {self.grammar.key[:12]} is complete (it accepted a stop "
                               "token): nothing more may be generated under it")
        apply_mask(logits.view(1, -1), self._row)
        return logits


class DraftMasks:
    """A speculative round under a constraint: the pending token x0 is accepted for good (the
    round commits it), drafts on trial; row j of `rows` is the mask after x0 and drafts 1..j.
    close() rolls the trial drafts back."""

    def __init__(self, c: Constraint, x0: int, k: int):
        c.require(x0)
        self.c, self.n = c, 0
        self.rows = new_bitmask(k + 1, c.grammars.vocab_size)
        self.open = c.fill(self.rows, 0)

    def push(self, d: int) -> bool:
        """Accept draft d on trial; False when the grammar is done or refuses it."""
        if not self.open or self.n + 1 >= self.rows.shape[0] or not self.c.accept(d):
            return False
        self.n += 1
        self.open = self.c.fill(self.rows, self.n)
        return True

    def trial(self, drafts: list[int], q=None):
        """(drafts, q) cut before the first draft the grammar refuses; the rest on trial."""
        while self.n < len(drafts) and self.push(drafts[self.n]):
            pass
        return drafts[: self.n], (None if q is None else q[: self.n])

    def apply(self, logits: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Mask logits (T, V) in place with rows first..first+T-1."""
        return apply_mask(logits, self.rows[first: first + logits.shape[0]])

    def close(self) -> None:
        self.c.rollback(self.n)
        self.n = 0
