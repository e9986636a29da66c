"""An agent's tool loop over HTTP (a ReAct loop of --steps steps, 6 by default) on the Qwen3.5-0.8B
shape with its released chat template: per-step TTFT and cached tokens for `flashrt serve`, for a
plain turn on the same tokens, for the same server re-prefilling, and for llama-cpp-python's
server; what grammar masking adds to a decode step; and a LangGraph agent's replayed and forked
step after store pressure, with and without checkpoints that retain their capsules (random weights).

The loop: a system prompt, three tools (search(page), weather(days), clock()) rendered by the
template, a user question; steps 1 to steps-1 POST /v1/chat/completions with the growing message
list, tool_choice "required" and parallel_tool_calls false (the grammar forces one call, so random
weights still call a tool), and the bench runs the tool (a fixed text per call) and appends the
assistant's `content: null` + tool_calls and the `tool` message; the last step asks for text
(tool_choice "none", same tools: the prompt stays prefix-stable). Streamed, greedy, usage included.

  flashrt        `flashrt serve` as it is (capsules at each prompt end and turn end). Random weights
                 write a call in a form the template renders back differently (xgrammar's Qwen3.5
                 tag takes a value without the newlines the template puts around it, and a call
                 without arguments with two newlines where the template writes one; a trained
                 model writes the template's form), so a step reuses the previous prompt's capsule and
                 prefills the rendered call, the tool result and the generation prompt; the
                 requests carry a logit_bias (blanks down, the tag tokens and <|im_end|> up) so a
                 call ends within --call-tokens and uses the tag tokens the template's text
                 tokenizes to
  plain turn     the reference of the acceptance line "a plain turn's TTFT on the same tokens":
                 POST /v1/completions of exactly the step's prompt ids (tokenized here with the
                 server's template and tokenizer, checked against its prompt_tokens), no tools,
                 no grammar, no bias, max_tokens 1, on the same server in its own cache namespace
                 (cache_salt), after an untimed request that leaves exactly the prefix the agent's
                 step reused in that namespace: the same cached tokens, the same new tokens,
                 the same server; only the chat rendering, the tools' grammar, the bias and the
                 reply parser differ. Each step the two alternate which goes first.
  re-prefill     the same server with --capsule-budget-mb 0 (no reuse), replaying the loop's
                 messages: every step a cold prefill (max_tokens 1: only TTFT is measured there)
  llama-cpp      llama-cpp-python's own OpenAI server (`python -m llama_cpp.server --cache true`,
                 its prompt cache) on a GGUF of the same weights and tokenizer, the template in the
                 GGUF. Step 1 uses its own tool support: /v1/chat/completions with the tools and a
                 named tool_choice (its only forced choice: a grammar of the arguments' JSON
                 schema; "required" is not constrained there). Later steps cannot go through its
                 chat endpoint: the released Qwen3.5 template iterates `arguments|items`, and its
                 server takes arguments only as the JSON string OpenAI's wire carries (refused as
                 an object, "Can only get item pairs from a mapping" as a string): a 500. So steps
                 2+ send the same prompt text flashrt rendered to its /v1/completions (max_tokens
                 4, a bias to letters so the first token has text to stream). Its cached tokens
                 are read from its log (prefix-match hit, prompt eval count): on Qwen3.5's
                 recurrent layers llama.cpp cannot cut the live state back to a shared prefix
                 ("partial kv removal not supported"), and its RAM cache holds states at prompt +
                 its own reply, never a prefix of the next prompt, so each step re-evaluates the
                 whole prompt
  LangGraph      (issue 34; bench/agent_resume.py, its own module: this file is long already) a
                 create_react_agent loop on a server with a small capsule budget; after store
                 pressure, a time-travel replay and an update_state fork of its last model step,
                 with flashrt's RetainingSaver and with a plain InMemorySaver, against a warm turn
                 on the same tokens (--resume-steps, --resume-budget-mb, --no-resume)

TTFT = request sent -> first SSE chunk with a choice (flashrt streams one chunk per token; llama-cpp
a chunk when the first token's text is out), on one keep-alive client. Each server first runs an
untimed warm-up of the same shape in another cache namespace (flashrt: a 2-step loop, which also
compiles the tools' grammar: no timed step includes a compile; compile time is in the mask table).
Repeats replay the same conversation (flashrt: in a fresh namespace, cache_salt, of the same
server; greedy, so every repeat writes the same calls: checked).

Grammar masking: in-process (flashrt.lm), the step-1 prompt prefilled and snapshotted, then
--mask-steps greedy decode steps from the restored capsule without a grammar, under the loop's
tool-call grammar (the server's: xgrammar's qwen_3_5 tag, required, one call) and under a JSON
schema string (many tokens allowed each step), alternated round by round; ms per decode step and
the ratio. A masked step fills xgrammar's bitmask on the host, masks a copy of the logits and
samples there (on CUDA it leaves the fused decode graph for the per-size step graph).

The chat checkpoint: make_checkpoint(..., chat=True) (byte-level tokenizer, the family's tags as
single tokens, the released template; same weights as the plain one). Its tokenizer has one token
per byte, so prompts are about 3-4x the token count Qwen's own tokenizer gives the same text; the
work per token is the real shape's.

    python bench/agent.py --llama-src /work/llama-src/llama_cpp_python-0.3.36   # Qwen3.5-0.8B shape
    python bench/agent.py --quick               # tiny, 3 steps: proves the script runs
    flashrt bench agent --size small --no-llama
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import agent_resume, common as C  # noqa: E402
from bench.agent_tools import (QUESTION, SYSTEM, TOOLS, cached_of, run_tool,  # noqa: E402,F401
                               stream)

ACCEPT_MASK, ACCEPT_STEP = 0.05, 1.2          # the acceptance lines
WARMUP = ("You are a terse assistant.", "What time is it where I am going?")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# the JSON grammar of the mask table: a string it cannot end before minLength
NOTE_SCHEMA = {"type": "object", "properties": {"note": {"type": "string", "minLength": 256}},
               "required": ["note"], "additionalProperties": False}


def parse(argv):
    p = C.base_parser("bench/agent.py", "An agent's tool loop over HTTP: per-step TTFT and cached tokens, "
                      "flashrt vs a plain turn vs re-prefill vs llama-cpp-python; grammar masking per decode step")
    p.add_argument("--size", default=None, help="qwen3_5 size: tiny | small | real (default real; --quick tiny)")
    p.add_argument("--steps", type=int, default=None, help="loop steps, the last one text (default 6; --quick 3)")
    p.add_argument("--call-tokens", type=int, default=80,
                   help="max_tokens of a tool-call step (a call is 35-65 tokens of this tokenizer)")
    p.add_argument("--answer-tokens", type=int, default=None, help="max_tokens of the last step (default 16)")
    p.add_argument("--mask-steps", type=int, default=None, help="decode steps per mask sample (default 16)")
    p.add_argument("--mask-repeats", type=int, default=None, help="mask samples per case (default 5)")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--no-llama", action="store_true", help="skip llama-cpp-python's server")
    p.add_argument("--llama-python", default=sys.executable,
                   help="python with llama-cpp-python[server] (default: this one)")
    p.add_argument("--llama-src", default=None,
                   help="llama-cpp-python's unpacked source tarball (its converter), to make the GGUF once")
    p.add_argument("--gguf", default=None, help="the GGUF for llama-cpp (default ~/.cache/flashrt/gguf/"
                   "qwen3_5-<size>-chat-<dtype>.gguf, made from the chat checkpoint with --llama-src)")
    p.add_argument("--plot", default=None, help="PNG path (default next to the JSON)")
    agent_resume.add_args(p)
    a = p.parse_args(argv)
    a.threads = a.threads or 2
    C.setup(a)
    a.size = a.size or ("tiny" if a.quick else "real")
    a.steps = a.steps or (3 if a.quick else 6)
    for flag, v in (("--steps", a.steps), ("--resume-steps", a.resume_steps)):
        if v < 2:
            raise SystemExit(f"{flag} {v}: expected >= 2 (tool calls, then a text answer)")
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.warmup = (0 if a.quick else 1) if a.warmup is None else a.warmup
    a.answer_tokens = a.answer_tokens or (4 if a.quick else 16)
    a.mask_steps = a.mask_steps or (4 if a.quick else 16)
    a.mask_repeats = a.mask_repeats or (1 if a.quick else 5)
    return a


# ---- the client's side of the loop -------------------------------------------------------------
def valid_call(call: dict) -> bool:
    """A call of one of TOOLS whose arguments are JSON its schema accepts (integers in range)."""
    fn = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}.get(call["name"])
    try:
        args = json.loads(call["arguments"] or "{}")
    except ValueError:
        return False
    if fn is None or not isinstance(args, dict) or set(args) != set(fn["properties"]):
        return False
    return all(type(v) is int and fn["properties"][k]["minimum"] <= v <= fn["properties"][k]["maximum"]
               for k, v in args.items())


class Conversation:
    """The message list, rendered and tokenized exactly as the server renders it (flashrt.chat
    with the checkpoint's template; its tokenizer), so each step's prompt ids are known here."""

    def __init__(self, ckpt: Path, tok, system: str, question: str):
        from flashrt.chat import ChatTemplate
        self.template, self.tok = ChatTemplate(ckpt), tok
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]

    def prompt(self) -> str:
        from flashrt.chat import prepare_messages
        return self.template.render(prepare_messages(self.messages, self.template.family), tools=TOOLS,
                                    template_kwargs={"enable_thinking": False})

    def ids(self, text: str) -> list:
        return self.tok.encode(text)

    def add(self, call: dict) -> str:
        result = run_tool(call["name"], json.loads(call["arguments"] or "{}"))
        self.messages += [{"role": "assistant", "content": None, "tool_calls": [
                              {"id": call["id"], "type": "function",
                               "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                          {"role": "tool", "tool_call_id": call["id"], "content": result}]
        return result


def token_id(tok, text: str) -> int:
    ids = tok.encode(text)
    if len(ids) != 1:
        raise RuntimeError(f"{text!r} is {len(ids)} tokens in this tokenizer; the bench needs it as one")
    return ids[0]


def call_bias(tok) -> dict:
    """Blanks down (newline less: the tag needs some), the tag tokens and <|im_end|> up: random
    weights then end a call within --call-tokens, and write <tool_call> as the one token the
    template's text tokenizes to (not its bytes)."""
    bias = {str(token_id(tok, c)): -100.0 for c in " \t\r"}
    bias[str(token_id(tok, "\n"))] = -50.0
    bias.update({str(token_id(tok, t)): 100.0 for t in ("<tool_call>", "</tool_call>", "<|im_end|>")})
    return bias


def text_bias(tok) -> dict:
    """Letters up: a text reply whose every token has text to stream (llama-cpp streams text)."""
    return {str(token_id(tok, c)): 100.0 for c in LETTERS}


# ---- HTTP ----------------------------------------------------------------------------------------
def flashrt_body(model, messages, forced: bool, a, bias, salt: str, max_tokens: int | None = None) -> dict:
    body = {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": "required" if forced else "none",
            "parallel_tool_calls": False, "temperature": 0,
            "max_tokens": max_tokens or (a.call_tokens if forced else a.answer_tokens),
            "chat_template_kwargs": {"enable_thinking": False}, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": salt}
    if forced:
        body["logit_bias"] = bias
    return body


def plain_body(model, ids, salt: str, avoid: int | None = None) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": salt}
    if avoid is not None:            # its turn end must not run into the prompt it prepares
        body["logit_bias"] = {str(avoid): -100.0}
    return body


def flashrt_loop(srv, client, ckpt, tok, a, biases, salt: str, system=SYSTEM, question=QUESTION,
                 steps=None, plain=True) -> list:
    """The loop on `srv` in namespace salt; with plain, each step's plain turn in namespace
    salt + "-plain" (the two alternate which goes first). Returns one record per step."""
    conv, model = Conversation(ckpt, tok, system, question), srv.model
    chat, comp = srv.url + "/v1/chat/completions", srv.url + "/v1/completions"
    stored, out = [], []            # token lists the agent's namespace holds capsules of
    steps = steps or a.steps
    for i in range(steps):
        forced = i < steps - 1
        text = conv.prompt()
        ids = conv.ids(text)
        predicted = max((len(b) for b in stored if ids[:len(b)] == b), default=0)
        msgs = json.loads(json.dumps(conv.messages))
        body = flashrt_body(model, msgs, forced, a, biases["call"], salt)
        rec = {"step": i + 1, "forced": forced, "messages": msgs, "prompt": text, "prompt_ids": len(ids),
               "predicted_cached": predicted}

        def agent():
            rec["agent"] = stream(client, chat, body)

        def reference():
            if predicted:           # untimed: the agent's reused prefix, in the plain namespace
                stream(client, comp, plain_body(model, ids[:predicted], salt + "-plain", ids[predicted]))
            rec["plain"] = stream(client, comp, plain_body(model, ids, salt + "-plain"))
        order = (agent, reference) if i % 2 == 0 else (reference, agent)
        for fn in order if plain else (agent,):
            fn()
        r = rec["agent"]
        stored += [ids, ids + r["ids"]]
        if forced:
            if r["finish"] != "tool_calls" or len(r["calls"]) != 1:
                raise RuntimeError(f"step {i + 1}: expected one tool call, got finish {r['finish']!r} and "
                                   f"{r['calls']} (raise --call-tokens?)")
            rec["result"] = conv.add(r["calls"][0])
        out.append(rec)
    return out


def replay(srv, client, trajectory, a, biases, salt: str) -> list:
    """The loop's messages sent as they were (the re-prefill server), max_tokens 1."""
    model = srv.model
    return [stream(client, srv.url + "/v1/chat/completions",
                   flashrt_body(model, s["messages"], s["forced"], a, biases["call"], salt, max_tokens=1))
            for s in trajectory]


# ---- llama-cpp-python ------------------------------------------------------------------------------
class LlamaLog:
    """What llama-cpp-python's server printed for each request (it is verbose by default)."""

    def __init__(self, path: Path):
        self.f = open(path, errors="replace")
        self.f.seek(0, 2)

    def take(self, timeout: float = 10.0) -> dict:
        text, deadline = "", time.time() + timeout
        while "prompt eval time" not in text and time.time() < deadline:
            text += self.f.read()
            time.sleep(0.05)
        text += self.f.read()
        hit = re.search(r"(\d+) prefix-match hit, remaining (\d+)", text)
        ev = re.search(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", text)
        evaluated = int(ev.group(1)) if ev else 0
        cached = int(hit.group(1)) if hit else 0
        return {"cached": cached, "evaluated": evaluated, "prompt_tokens": cached + evaluated,
                "partial_removal_refused": "partial kv removal not supported" in text,
                "ram_cache_hit": "cache hit" in text}


def llama_loop(srv, client, log: LlamaLog, trajectory, a, biases, first_tool: str) -> list:
    out = []
    for s in trajectory:
        if s["step"] == 1:          # its own tool support: a named choice, its JSON-schema grammar
            body = {"model": srv.model, "messages": s["messages"], "tools": TOOLS,
                    "tool_choice": {"type": "function", "function": {"name": first_tool}},
                    "max_tokens": a.call_tokens, "temperature": 0, "repeat_penalty": 1.0, "stream": True}
            r = stream(client, srv.url + "/v1/chat/completions", body)
            r["call_valid"] = bool(r["calls"]) and valid_call(r["calls"][0])
        else:                       # its chat endpoint cannot render the history (see the docstring)
            body = {"model": srv.model, "prompt": s["prompt"], "max_tokens": 4, "temperature": 0,
                    "repeat_penalty": 1.0, "stream": True, "logit_bias": biases["text"]}
            r = stream(client, srv.url + "/v1/completions", body)
        r.update(log.take())
        out.append(r)
    return out


def llama_gguf(ckpt: Path, a) -> tuple:
    """(GGUF path, None) or (None, why the llama-cpp column is absent)."""
    from bench.gguf import gguf_path
    if a.no_llama:
        return None, "skipped (--no-llama)"
    if a.device != "cpu":
        return None, "llama-cpp-python is built for the CPU here; this run is on " + a.device
    r = subprocess.run([a.llama_python, "-c", "import llama_cpp.server.app"], capture_output=True, text=True,
                       cwd=tempfile.gettempdir())
    if r.returncode != 0:
        return None, (f"llama-cpp-python's server is not importable by {a.llama_python} (pip install "
                      f"'llama-cpp-python[server]==0.3.36'): {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    g = Path(a.gguf) if a.gguf else gguf_path("qwen3_5", f"{a.size}-chat", a.dtype)
    if not g.exists():
        if not a.llama_src:
            return None, (f"no GGUF at {C.short_path(g)}: give --llama-src (llama-cpp-python's source "
                          "tarball) to make it from the chat checkpoint")
        chat_gguf(ckpt, a.dtype, Path(a.llama_src), g)
    return g, None


def chat_gguf(ckpt: Path, dtype: str, llama_src: Path, out: Path) -> Path:
    """The chat checkpoint as GGUF, by bench/gguf.py's converter. llama.cpp refuses a BPE
    vocabulary without merges, and the chat tokenizer has none: the staged tokenizer.json gets
    one that never fires (two NUL bytes), its token after the added ones, which also enter the
    model vocabulary so their ids stay put. Ids, template and tags are otherwise the checkpoint's."""
    from bench.gguf import convert_dir
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
    nul = "\u0100"                                  # byte 0 in the byte-level alphabet
    vocab[nul + nul] = max(vocab.values()) + 1
    tok["model"]["merges"] = [[nul, nul]]
    with tempfile.TemporaryDirectory(prefix="flashrt-agent-gguf-") as tmp:
        for f in ckpt.iterdir():
            if f.suffix in (".json", ".safetensors") and f.name not in ("tokenizer.json", "flashrt_checkpoint.json"):
                (Path(tmp) / f.name).symlink_to(f.resolve())
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        return convert_dir(Path(tmp), "qwen3_5", dtype, llama_src, out)


# ---- grammar masking per decode step, in-process ---------------------------------------------------
def mask_overhead(ckpt: Path, a, prompt_ids: list) -> dict:
    """On a worker thread, as the server's engine steps (see bench/serve.py in_process)."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(_mask_overhead, ckpt, a, prompt_ids).result()


def _mask_overhead(ckpt: Path, a, prompt_ids: list) -> dict:
    import torch

    from flashrt.lm import Grammar, load
    from flashrt.serve.replies import MAX_WHITESPACE, TOOL_GRAMMARS
    torch.set_num_threads(a.threads)
    n = a.mask_steps
    rt = load(ckpt, device=a.device, dtype=a.dtype, max_seq_len=len(prompt_ids) + n + 8)
    rt.prefill(prompt_ids)
    cap = rt.snapshot()
    grammars = {"tool call (the loop's)": Grammar.tool_calls(TOOLS, "required", False, TOOL_GRAMMARS["qwen3_5"],
                                                             "disabled", MAX_WHITESPACE),
                "JSON string (minLength 256)": Grammar.json_schema(NOTE_SCHEMA, True, "disabled", MAX_WHITESPACE)}
    compile_ms = {}
    for name, g in grammars.items():
        t0 = time.perf_counter()
        rt.grammars.compile(g)
        compile_ms[name] = (time.perf_counter() - t0) * 1e3
    lengths = {}

    def case(name, g):
        def post(out):
            lengths.setdefault(name, []).append(len(out))
        return C.Case(lambda: rt.generate(max_new_tokens=n, temperature=0.0, ignore_eos=True, grammar=g),
                      setup=lambda: rt.restore(cap), post=post)
    cases = {"no grammar": case("no grammar", None)} | {k: case(k, g) for k, g in grammars.items()}
    st = C.measure_alt(cases, a.mask_repeats, a.warmup, a.device, desc="grammar masking")
    base = st["no grammar"].median / n
    rows = {k: {"stats": s, "ms_per_step": s.median / n * 1e3, "ratio": s.median / n / base,
                "steps": lengths.get(k, []), "compile_ms": compile_ms.get(k)} for k, s in st.items()}
    return {"steps": n, "position": len(prompt_ids), "rows": rows,
            "all_steps_made": all(x == n for v in lengths.values() for x in v),
            "linear_kernel": rt.model.linear_kernel}


# ---- tables and plot ---------------------------------------------------------------------------------
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) * 1e3 if xs else None


def ms(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def describe(rec) -> str:
    if not rec["forced"]:
        return "text (tool_choice none)"
    c = rec["agent"]["calls"][0]
    args = ", ".join(f"{k}={v}" for k, v in json.loads(c["arguments"] or "{}").items())
    return f"call {c['name']}({args})"


def rows_of(runs, a) -> list:
    rows = []
    for i in range(a.steps):
        f = [r[i] for r in runs["flashrt"]]
        rp = [r[i] for r in runs["reprefill"]]
        ll = [r[i] for r in runs["llama"]]
        u = f[0]["agent"]["usage"]
        row = {"step": i + 1, "request": describe(f[0]), "prompt_tokens": u["prompt_tokens"],
               "cached": cached_of(f[0]["agent"]), "flashrt_ms": med([x["agent"]["ttft"] for x in f]),
               "plain_ms": med([x["plain"]["ttft"] for x in f]),
               "reprefill_ms": med([x["ttft"] for x in rp]) if rp else None,
               "llama_ms": med([x["ttft"] for x in ll]) if ll else None,
               "llama_cached": ll[0]["cached"] if ll else None,
               "completion_tokens": f[0]["agent"]["usage"]["completion_tokens"]}
        row["new"] = row["prompt_tokens"] - row["cached"]
        row["flashrt_vs_plain"] = row["flashrt_ms"] / row["plain_ms"]
        rows.append(row)
    return rows


def checks_of(runs, a) -> dict:
    fl = [s for r in runs["flashrt"] for s in r]
    ch = {"prompt_ids_as_server": all(s["agent"]["usage"]["prompt_tokens"] == s["prompt_ids"] for s in fl),
          "agent_cached_as_predicted": all(cached_of(s["agent"]) == s["predicted_cached"] for s in fl),
          "plain_same_tokens": all(s["plain"]["usage"]["prompt_tokens"] == s["prompt_ids"]
                                   and cached_of(s["plain"]) == cached_of(s["agent"]) for s in fl),
          "reuse_each_step": all(cached_of(r[i]["agent"]) >= r[i - 1]["prompt_ids"]
                                 for r in runs["flashrt"] for i in range(1, len(r))),
          "calls_valid": all(valid_call(s["agent"]["calls"][0]) for s in fl if s["forced"]),
          "repeats_identical": all([s["agent"]["ids"] for s in r] == [s["agent"]["ids"] for s in runs["flashrt"][0]]
                                   for r in runs["flashrt"])}
    if runs["reprefill"]:
        ch["reprefill_cold"] = all(cached_of(x) == 0 and x["usage"]["prompt_tokens"] == s["prompt_ids"]
                                   for r in runs["reprefill"] for x, s in zip(r, runs["flashrt"][0]))
    if runs["llama"]:
        ch["llama_same_prompt_tokens"] = all(x["prompt_tokens"] == s["prompt_ids"]
                                             for r in runs["llama"] for x, s in zip(r, runs["flashrt"][0]))
    return ch


def tables(a, rows, mask, notes, load_note, resume) -> list:
    later = [r for r in rows if r["step"] > 1]
    worst = max(later, key=lambda r: r["flashrt_vs_plain"])
    acc = C.Table(f"Acceptance (issues 33, 34): grammar masking per decode step and the loop's steps against a "
                  f"plain turn ({C.label('qwen3_5', a.size)}, {a.device}, {a.dtype}, {a.threads} threads)",
                  ["criterion", "measured", "line", "met"])
    base = mask["rows"]["no grammar"]
    for k, r in mask["rows"].items():
        if k == "no grammar":
            continue
        acc.add(f"grammar masking adds to a decode step: {k}",
                f"{r['ms_per_step']:.2f} vs {base['ms_per_step']:.2f} ms: {100 * (r['ratio'] - 1):+.1f}%",
                f"< +{100 * ACCEPT_MASK:.0f}%", "yes" if r["ratio"] - 1 < ACCEPT_MASK else "no")
    acc.add(f"loop steps 2-{a.steps} TTFT vs a plain turn on the same tokens (flashrt)",
            f"at most {worst['flashrt_vs_plain']:.2f}x (step {worst['step']})", f"<= {ACCEPT_STEP:.2f}x",
            "yes" if worst["flashrt_vs_plain"] <= ACCEPT_STEP else "no")
    agent_resume.accept(acc, resume)
    acc.notes += [f"machine load: {load_note}; masking: medians of {a.mask_repeats} samples of {mask['steps']} "
                  f"greedy steps at position {mask['position']}, alternated; loop: medians of {a.repeats} repeats"]
    llama = rows[0]["llama_ms"] is not None
    t = C.Table(f"Agent loop over HTTP: TTFT per step ({C.label('qwen3_5', a.size)}, {a.device}, {a.dtype}, "
                f"{a.threads} threads; {len(TOOLS)} tools, released template; median of {a.repeats})",
                ["step", "request", "prompt tok", "cached tok", "new tok", "flashrt ms", "plain turn ms",
                 "flashrt/plain", "re-prefill ms", "re-prefill/flashrt"]
                + (["llama-cpp ms", "llama-cpp cached tok", "llama-cpp/flashrt"] if llama else []))
    for r in rows:
        rp = r["reprefill_ms"]
        t.add(r["step"], r["request"], r["prompt_tokens"], r["cached"], r["new"], ms(r["flashrt_ms"]),
              ms(r["plain_ms"]), C.fmt_ratio(r["flashrt_vs_plain"]), ms(rp),
              C.fmt_ratio(rp / r["flashrt_ms"] if rp else None),
              *([ms(r["llama_ms"]), r["llama_cached"], C.fmt_ratio(r["llama_ms"] / r["flashrt_ms"])] if llama else []))
    t.notes += [f"flashrt: tool_choice required, parallel_tool_calls false, greedy, a logit_bias that ends calls "
                f"(bench/agent.py); the last step tool_choice none; max_tokens {a.call_tokens} / {a.answer_tokens}",
                "cached tok: the previous step's prompt (the call as random weights wrote it is not the "
                "template's rendering, so the turn-end capsule is not a prefix); new tok: the call as rendered, "
                "the tool result, the generation prompt",
                "plain turn: /v1/completions of the same prompt ids, no tools, grammar or bias, max_tokens 1, "
                "same server, its own cache namespace holding the same prefix (same cached and new tokens)",
                "re-prefill: the same server with --capsule-budget-mb 0 (cached tok 0 every step)"]
    if llama:
        call = notes["llama_call"]
        t.notes += [f"llama-cpp: `python -m llama_cpp.server --cache true --n_threads {a.threads}` on a GGUF of the "
                    "same weights and tokenizer; step 1 its chat endpoint with a named tool_choice (its "
                    "JSON-schema grammar), later steps the same prompt text to /v1/completions: its chat "
                    "endpoint cannot render the released Qwen3.5 template's tool history (see bench/agent.py)",
                    "llama-cpp cached tok: from its log; on Qwen3.5's recurrent layers it cannot cut its state "
                    "back to a shared prefix, and it holds none at a prompt end",
                    f"llama-cpp's own step-1 call: {call['name']} {call['arguments']} ("
                    + ("valid" if call["valid"] else "not valid") + " against the tool's schema)"]
        if notes["llama"]:
            t.notes.append(notes["llama"])
    else:
        t.notes.append(f"llama-cpp-python: not measured ({notes['llama']})")
    t.notes.append(C.RANDOM_NOTE + "; the chat checkpoint's tokenizer has one token per byte (prompts ~3-4x "
                   "Qwen's own token count for the same text)")
    m = C.Table(f"Grammar masking per decode step, in-process ({C.label('qwen3_5', a.size)}, {a.device}, "
                f"{a.dtype}; {mask['steps']} greedy steps after a {mask['position']}-token prompt)",
                ["grammar", "ms per step [min-max]", "vs no grammar", "compile ms (first use)"])
    for k, r in mask["rows"].items():
        s = r["stats"]
        m.add(k, f"{r['ms_per_step']:.2f} [{s.min / mask['steps'] * 1e3:.2f}-{s.max / mask['steps'] * 1e3:.2f}]",
              "-" if k == "no grammar" else f"{100 * (r['ratio'] - 1):+.1f}%",
              "-" if r["compile_ms"] is None else f"{r['compile_ms']:.0f}")
    m.notes += ["a masked step: xgrammar fills the bitmask on the host, a copy of the logits is masked, the "
                "token is drawn there and accepted (flashrt/lm/grammar.py); tool call: the server's grammar "
                "for this loop (xgrammar qwen_3_5 tag, required, one call); JSON string: a schema whose "
                "string cannot end within the steps, so most tokens are allowed each step",
                f"linear kernel {mask['linear_kernel']}"]
    return [acc, t, m] + ([agent_resume.table(resume, a)] if resume["measured"] else [])


def plot(rows, mask, path: Path, a, resume):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed ({path} not written)")
        return None
    n = 3 if resume["measured"] else 2
    fig, (ax, bx, *cx) = plt.subplots(1, n, figsize=(5.5 * n, 4), gridspec_kw={"width_ratios": [2, 1, 1.5][:n]})
    steps = [r["step"] for r in rows]
    for key, lab, mark in (("reprefill_ms", "same server, re-prefill", "s"),
                           ("llama_ms", "llama-cpp-python --cache", "^"),
                           ("plain_ms", "plain turn, same tokens", "x"), ("flashrt_ms", "flashrt serve", "o")):
        if rows[0][key] is not None:
            ax.plot(steps, [r[key] for r in rows], marker=mark, label=lab)
    ax.set_xticks(steps)
    ax.set_yscale("log")
    ax.set_xlabel("loop step (last: text)")
    ax.set_ylabel("TTFT ms (median)")
    ax.set_title(f"tool loop over HTTP, {C.label('qwen3_5', a.size)}, {a.device}", fontsize=9)
    ax.legend(fontsize=7)
    names = list(mask["rows"])
    bx.bar(range(len(names)), [mask["rows"][k]["ms_per_step"] for k in names], color=["C7", "C0", "C1"][:len(names)])
    bx.set_xticks(range(len(names)), [k.split(" (")[0] for k in names], fontsize=7)
    bx.set_ylabel("ms per decode step (median)")
    bx.set_title("grammar masking", fontsize=9)
    if cx:
        agent_resume.plot_panel(cx[0], resume)
    fig.suptitle("random weights", fontsize=8)
    C.save_figure(fig, path)
    return path


# ---- main ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    import httpx

    from bench.serve import LlamaServer, start_flashrt
    from flashrt.models.tokenizer import HFTokenizer
    a = parse(argv)
    info = C.banner("agent", a)
    load0 = os.getloadavg()
    ckpt = C.cached_checkpoint("qwen3_5", a.size, chat=True)
    tok = HFTokenizer(ckpt)
    biases = {"call": call_bias(tok), "text": text_bias(tok)}
    first = Conversation(ckpt, tok, SYSTEM, QUESTION)
    print(f"checkpoint {C.short_path(ckpt)}; step 1 prompt {len(first.ids(first.prompt()))} tokens", flush=True)
    mask = mask_overhead(ckpt, a, first.ids(first.prompt()))
    C.free_memory()
    runs = {"flashrt": [], "reprefill": [], "llama": []}
    client = httpx.Client(timeout=1800)
    srv = start_flashrt(ckpt, a, 4096)
    try:
        flashrt_loop(srv, client, ckpt, tok, a, biases, "warmup", *WARMUP, steps=2)
        for rep in C.progress(range(a.repeats), desc="flashrt + plain turn"):
            runs["flashrt"].append(flashrt_loop(srv, client, ckpt, tok, a, biases, f"loop-{rep}"))
    finally:
        srv.stop()
    trajectory = runs["flashrt"][0]
    srv = start_flashrt(ckpt, a, 0)
    try:
        replay(srv, client, trajectory[:1], a, biases, "warmup")
        for rep in C.progress(range(a.repeats), desc="re-prefill"):
            runs["reprefill"].append(replay(srv, client, trajectory, a, biases, f"loop-{rep}"))
    finally:
        srv.stop()
    resume = agent_resume.measure(ckpt, tok, a, biases, len(first.ids(first.prompt())))
    notes = {"llama": None}
    gguf, notes["llama"] = llama_gguf(ckpt, a)
    if gguf is not None:
        srv = LlamaServer(a.llama_python, gguf, a)
        try:
            log = LlamaLog(srv.log_path)
            wconv = Conversation(ckpt, tok, *WARMUP)
            stream(client, srv.url + "/v1/chat/completions",
                   {"model": srv.model, "messages": wconv.messages, "tools": TOOLS, "max_tokens": 4,
                    "tool_choice": {"type": "function", "function": {"name": "clock"}}, "stream": True})
            log.take()
            first_tool = trajectory[0]["agent"]["calls"][0]["name"]
            for rep in C.progress(range(a.repeats), desc="llama-cpp"):
                try:
                    runs["llama"].append(llama_loop(srv, client, log, trajectory, a, biases, first_tool))
                except (httpx.HTTPError, KeyError, ValueError) as e:
                    # a column of another program: its failure keeps the rows measured so far
                    notes["llama"] = (f"llama-cpp-python's server failed in repeat {rep + 1} "
                                      f"({type(e).__name__}: {e}); {len(runs['llama'])} repeats kept; "
                                      f"its log: {srv.log_path}")
                    break
            if runs["llama"]:
                own = runs["llama"][0][0]
                notes["llama_call"] = {**(own["calls"] or [{"name": first_tool, "arguments": ""}])[0],
                                       "valid": own["call_valid"]}
            log.f.close()
        finally:
            srv.stop()
    client.close()
    load1 = os.getloadavg()
    rows = rows_of(runs, a)
    checks = checks_of(runs, a)
    checks["mask_all_steps_made"] = mask["all_steps_made"]
    checks.update({f"resume_{k}": v for k, v in resume.get("checks", {}).items()})
    tabs = tables(a, rows, mask, notes, f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end", resume)
    C.print_tables(tabs)
    bad = [k for k, v in checks.items() if not v]
    print(f"checks: {'all hold' if not bad else 'FAILED: ' + ', '.join(bad)} ({', '.join(checks)})")
    res = C.result_path("agent", a)
    png = plot(rows, mask, Path(a.plot) if a.plot else res.with_suffix(".png"), a, resume)
    slim = {k: [[{kk: vv for kk, vv in s.items() if kk not in ("messages", "prompt")} for s in r] for r in v]
            for k, v in runs.items()}
    data = {"size": a.size, "checkpoint": C.short_path(ckpt), "steps": a.steps, "repeats": a.repeats,
            "tools": TOOLS, "biases": biases, "call_tokens": a.call_tokens, "answer_tokens": a.answer_tokens,
            "gguf": C.short_path(gguf) if gguf else None, "notes": notes, "rows": rows, "mask": mask,
            "checks": checks, "runs": slim, "messages": trajectory[-1]["messages"], "resume": resume,
            "load_average": [load0, load1],
            "plot": str(png.relative_to(C.ROOT)) if png and png.is_relative_to(C.ROOT) else png}
    C.write_json("agent", a, info, tabs, data, argv)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
