"""flashrt bench serve: a voice-agent dialogue over HTTP, TTFT per turn (random weights).

The dialogue: a system prompt, then turns of (user text -> streamed greedy reply); at the
barge-in turn the client cuts the reply off after a few tokens, and the next turn appends to
what was delivered, as a voice agent does after an interruption. Per turn:

  flashrt        `flashrt serve` (capsules at prompt and turn ends; restore/extend, prefill the rest);
                 the barge-in is POST .../cancel with delivered_tokens
  re-prefill     the same server with --capsule-budget-mb 0: every prompt prefilled in full,
                 what a voice framework gets today after it cancels and re-sends the conversation
  in-process     LanguageModel.set_context(same token ids, CapsuleStore) + the greedy token in
                 this process: the capsule TTFT with no HTTP, to show the server's overhead
  llama-cpp      llama-cpp-python's own OpenAI server (`--llama-python`, its own venv) on a GGUF
                 of the same weights with --cache true; the barge-in is a disconnect (its API
                 has no cancel)

Every server gets identical text (built from flashrt's replies), and the bench asserts equal
prompt token counts. For text to round-trip, the run uses a copy of the checkpoint that speaks
text (`text_checkpoint`): bench/gguf.py's byte-level tokenizer, and the tied embedding rows of
ids outside a 61-character alphabet zeroed, so greedy replies are alphabet characters that
re-tokenize to the same ids (a random model otherwise emits ids with no text, and no server
could reuse its own reply). The shape and the work per token are the original's.

TTFT over HTTP = request sent -> first SSE chunk (one chunk per token), on one keep-alive
client; the flashrt and llama-cpp servers and the in-process run first do one untimed dialogue
of the same shape (the re-prefill server gets only the short warm-up turn of dialogue(): it
stores nothing a warm-up could prepare, and its turns are whole prefills anyway).

    python bench/serve.py --system-tokens 512 --turns 8 --barge-turn 4
    python bench/serve.py --llama-python /path/llama-venv/bin/python --llama-src llama_cpp_python-0.3.36
"""
from __future__ import annotations

import json
import random
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

# one token per character under gguf.py's tokenizer: its merges ("Ġt", "he", "Ġthe") need a
# space or an "h", so no concatenation of these characters merges
ALPHABET = "".join(ch for ch in string.ascii_letters + string.digits if ch != "h")


def parse(argv):
    p = C.base_parser("bench/serve.py", "voice-agent dialogue over HTTP: per-turn TTFT")
    p.add_argument("--arch", default="qwen3_5")
    p.add_argument("--size", default="real", help="tiny | small | real (Qwen3.5-0.8B shape)")
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--barge-turn", type=int, default=4, help="turn whose reply is cut off (1-based)")
    p.add_argument("--barge-after", type=int, default=4, help="tokens delivered before the barge-in")
    p.add_argument("--user-tokens", type=int, default=16)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--llama-python", default=None,
                   help="python of a venv with llama-cpp-python[server]: adds its server's column")
    p.add_argument("--llama-src", default=None,
                   help="llama-cpp-python's unpacked source tarball (its converter), to make the GGUF once")
    p.add_argument("--plot", default=None, help="PNG path (default next to the JSON)")
    a = p.parse_args(argv)
    a.repeats = a.repeats or (1 if a.quick else 3)
    if a.quick:
        a.size, a.system_tokens, a.turns = "tiny", 64, 5
    return a


# ---- the checkpoint that speaks text --------------------------------------------------------
def text_checkpoint(ckpt: Path) -> Path:
    """`ckpt` with gguf.py's tokenizer and every embedding (= tied lm_head) row outside ALPHABET
    zeroed; made once next to it."""
    out = ckpt.parent / (ckpt.name + "-text")
    if (out / "flashrt_checkpoint.json").exists():
        return out
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    from bench.gguf import write_byte_tokenizer
    cfg = json.loads((ckpt / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    if not text_cfg.get("tie_word_embeddings", cfg.get("tie_word_embeddings")):
        raise SystemExit(f"{ckpt}: text_checkpoint expects tied embeddings")
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    eos = text_cfg.get("eos_token_id")
    write_byte_tokenizer(tmp, eos[0] if isinstance(eos, list) else eos)
    tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    keep = [tok.encode(ch).ids for ch in ALPHABET]
    assert all(len(k) == 1 for k in keep), "an alphabet character is not one token"
    mask = torch.ones(text_cfg["vocab_size"], dtype=torch.bool)
    mask[[k[0] for k in keep]] = False
    w = load_file(str(ckpt / "model.safetensors"))
    names = [n for n in w if n.endswith("embed_tokens.weight") and w[n].shape[0] == mask.numel()]
    assert names, "no embedding matrix found"
    for n in names:
        w[n][mask] = 0
    save_file(w, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json", "flashrt_checkpoint.json"):
        if (ckpt / f).exists():
            shutil.copy(ckpt / f, tmp / f)
    tmp.rename(out)
    return out


# ---- servers --------------------------------------------------------------------------------
def start_flashrt(ckpt, a, budget_mb, *extra):
    sys.path.insert(0, str(C.ROOT / "tests"))
    from serve_util import Server
    threads = ["--threads", str(a.threads)] if a.threads else []
    return Server(ckpt, "--capsule-budget-mb", str(budget_mb), "--max-sessions", "1",
                  "--max-seq-len", str(a.max_seq_len), "--dtype", a.dtype, "--device", a.device, *threads, *extra)


class LlamaServer:
    """`python -m llama_cpp.server` in its own venv (the command issue 16 names), on loopback."""

    def __init__(self, python, gguf, a):
        sys.path.insert(0, str(C.ROOT / "tests"))
        from serve_util import free_port, wait_until_up
        self.port = free_port()
        self.url, self.model = f"http://127.0.0.1:{self.port}", "llama"
        n = str(a.threads or 2)
        cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "llama",
               "--host", "127.0.0.1", "--port", str(self.port), "--n_threads", n, "--n_threads_batch", n,
               "--n_ctx", str(a.max_seq_len), "--cache", "true"]
        self.log_path = Path(tempfile.gettempdir()) / "flashrt-llama-server.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        wait_until_up(self.url, self.proc, 300, f"llama_cpp.server (see {self.log_path})")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---- one streamed turn ----------------------------------------------------------------------
def flashrt_turn(srv, client, prompt: str, a, barge: bool) -> dict:
    body = {"model": srv.model, "prompt": prompt, "max_tokens": a.reply_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    texts, ids, ttft, usage, rid, cut = [], [], None, None, None, False
    t0 = time.perf_counter()
    with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ttft is None:
                ttft = time.perf_counter() - t0
            rid = ev["id"]
            if ev.get("usage"):
                usage = ev["usage"]
            if ev["choices"] and ev["choices"][0]["token_ids"] and not cut:
                ids += ev["choices"][0]["token_ids"]
                texts.append(ev["choices"][0]["text"])
                if barge and len(ids) >= a.barge_after and ev["choices"][0]["finish_reason"] is None:
                    kept = srv.post(f"/v1/completions/{rid}/cancel", {"delivered_tokens": a.barge_after})
                    assert kept.status_code == 200 and kept.json()["kept_tokens"], kept.text
                    k = kept.json()["kept_tokens"][0]
                    ids, texts, barge, cut = ids[:k], texts[:k], False, True   # the rest is not spoken
    return {"ttft": ttft, "reply": "".join(texts), "reply_ids": ids,
            "prompt_tokens": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def llama_turn(srv, client, prompt: str, a, barge: bool) -> dict:
    n_prompt = client.post(srv.url + "/extras/tokenize/count", json={"input": prompt}).json()["count"]
    body = {"model": srv.model, "prompt": prompt, "max_tokens": a.reply_tokens, "temperature": 0,
            "repeat_penalty": 1.0, "stream": True}
    texts, ttft = [], None
    t0 = time.perf_counter()
    with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            texts.append(json.loads(line[6:])["choices"][0]["text"])
            if barge and len(texts) >= a.barge_after:
                break                  # a disconnect: llama-cpp-python's API has no cancel
    return {"ttft": ttft, "reply": "".join(texts), "prompt_tokens": n_prompt, "cached": None}


def script(a, seed):
    """The client's side of a dialogue: system text and one user text per turn."""
    r = random.Random(seed)
    text = lambda n: "".join(r.choice(ALPHABET) for _ in range(n))  # noqa: E731
    return text(a.system_tokens), [text(a.user_tokens) for _ in range(a.turns)]


def dialogue(turn, srv, a, seed, prompts=None):
    """Run the dialogue; prompts=None builds it from this server's replies (the history is
    prompt + delivered reply + next user text), else sends those prompts. One keep-alive
    client, as an agent holds: a fresh httpx client costs ~60 ms by itself."""
    import httpx
    client = httpx.Client(timeout=1200)
    system, users = script(a, seed)
    turn(srv, client, script(a, seed + 7)[0][:8], a, False)        # warm-up, unrelated
    history, out = system, []
    for t in range(1, a.turns + 1):
        prompt = prompts[t - 1]["prompt"] if prompts else history + users[t - 1]
        res = turn(srv, client, prompt, a, barge=(t == a.barge_turn))
        out.append(dict(res, turn=t, prompt=prompt))
        history = prompt + res["reply"]
    client.close()
    return out


def in_process(ckpt, a, turns):
    """in_process_steps on a worker thread, where the server's engine runs it too (torch's
    OpenMP team behaves differently on the main thread: up to 20x slower on a busy machine)."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(in_process_steps, ckpt, a, turns).result()


def in_process_steps(ckpt, a, turns):
    """Capsule TTFT on the same token ids, no HTTP: set_context + the greedy token per turn."""
    import torch

    from flashrt.capsules.store import CapsuleStore
    if a.threads:                 # per calling thread, as in the server's engine
        torch.set_num_threads(a.threads)
    rt = C.load_flashrt(ckpt, a, a.max_seq_len)
    ids = [rt.tokenizer.encode(t["prompt"]) for t in turns]
    assert [len(x) for x in ids] == [t["prompt_tokens"] for t in turns], "tokenizer differs from the server's"
    for _ in range(2):            # the first pass warms up (shapes, allocator); the second is timed
        store, out = CapsuleStore(device_bytes=8 << 30), []
        rt.reset()
        for t, p in zip(turns, ids):
            t0 = time.perf_counter()
            logits = rt.set_context(p, store=store)
            int(logits.argmax())                                       # the first greedy token
            out.append(time.perf_counter() - t0)
            rt.set_context(p + t["reply_ids"], store=store)           # the turn end, as served
    return out


def llama_gguf(ckpt: Path, a) -> Path:
    from bench.gguf import convert_dir, gguf_path
    out = gguf_path(a.arch, a.size + "-text", a.dtype)
    if not out.exists():
        if not a.llama_src:
            raise SystemExit(f"{out} missing: give --llama-src (llama-cpp-python's source tarball) to make it")
        convert_dir(ckpt, a.arch, a.dtype, Path(a.llama_src), out)
    return out


# ---- report ---------------------------------------------------------------------------------
SERIES = (("reprefill_ms", "cancel + full re-prefill (HTTP)"), ("llama_ms", "llama-cpp-python server --cache"),
          ("flashrt_ms", "flashrt serve (HTTP)"), ("inproc_ms", "in-process capsule"))


def plot(rows, path, a):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    turns = [r["turn"] for r in rows]
    for key, lab in SERIES:
        if rows[0].get(key) is not None:
            ax.plot(turns, [r[key] for r in rows], marker="o", label=lab)
    ax.axvline(a.barge_turn + 0.5, color="grey", ls=":", label="barge-in")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT ms (median)")
    ax.set_yscale("log")
    ax.set_title(f"voice-agent dialogue, {C.label(a.arch, a.size)}, {a.dtype} (random weights)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    a = parse(argv)
    C.setup(a)
    info = C.banner("serve", a)
    ckpt = text_checkpoint(C.checkpoint(a.arch, a.size))
    gguf = llama_gguf(ckpt, a) if a.llama_python else None
    runs = {"flashrt": [], "reprefill": [], "inproc": [], "llama": []}
    for rep in range(a.repeats):
        srv = start_flashrt(ckpt, a, 4096)
        try:
            dialogue(flashrt_turn, srv, a, seed=1000 + rep)       # untimed, same shape
            runs["flashrt"].append(dialogue(flashrt_turn, srv, a, seed=rep))
        finally:
            srv.stop()
        prompts = runs["flashrt"][-1]
        srv = start_flashrt(ckpt, a, 0)
        try:
            runs["reprefill"].append(dialogue(flashrt_turn, srv, a, seed=rep, prompts=prompts))
        finally:
            srv.stop()
        if gguf:
            srv = LlamaServer(a.llama_python, gguf, a)
            try:
                dialogue(llama_turn, srv, a, seed=1000 + rep)
                runs["llama"].append(dialogue(llama_turn, srv, a, seed=rep, prompts=prompts))
            finally:
                srv.stop()
        runs["inproc"].append(in_process(ckpt, a, prompts))
        print(f"repeat {rep + 1}/{a.repeats} done", flush=True)
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    rows = []
    for i in range(a.turns):
        f, b, ll = ([d[i] for d in runs[k]] for k in ("flashrt", "reprefill", "llama"))
        for other in (b, ll):        # the same text, repeat by repeat: the same token count
            assert all(x["prompt_tokens"] == y["prompt_tokens"] for x, y in zip(f, other)), "prompt tokens differ"
        rows.append({"turn": i + 1, "prompt_tokens": f[0]["prompt_tokens"], "cached": f[0]["cached"],
                     "flashrt_ms": med([x["ttft"] for x in f]), "reprefill_ms": med([x["ttft"] for x in b]),
                     "inproc_ms": med([d[i] for d in runs["inproc"]]),
                     "llama_ms": med([x["ttft"] for x in ll]) if ll else None,
                     "llama_same_reply": [x["reply"] == y["reply"] for x, y in zip(ll, f)],
                     "reprefill_cached": b[0]["cached"]})
    t = C.Table(f"TTFT per turn over HTTP ({C.label(a.arch, a.size)}, {a.device}, {a.dtype}; system "
                f"{a.system_tokens}, user {a.user_tokens}, reply {a.reply_tokens} tokens; median of {a.repeats})",
                ["turn", "prompt tok", "cached tok", "flashrt ms", "in-process ms", "flashrt/in-process",
                 "re-prefill ms", "re-prefill/flashrt"] + (["llama-cpp ms", "llama-cpp/flashrt"] if gguf else []))
    for r in rows:
        mark = " (after barge-in)" if r["turn"] == a.barge_turn + 1 else ""
        llama = [f"{r['llama_ms']:.1f}", C.fmt_ratio(r["llama_ms"] / r["flashrt_ms"])] if gguf else []
        t.add(f"{r['turn']}{mark}", r["prompt_tokens"], r["cached"], f"{r['flashrt_ms']:.1f}",
              f"{r['inproc_ms']:.1f}", C.fmt_ratio(r["flashrt_ms"] / r["inproc_ms"]),
              f"{r['reprefill_ms']:.1f}", C.fmt_ratio(r["reprefill_ms"] / r["flashrt_ms"]), *llama)
    t.notes += [f"turn {a.barge_turn}: cut off after {a.barge_after} tokens; the next turn appends to "
                "exactly what was delivered (flashrt: POST .../cancel with delivered_tokens)",
                "in-process: LanguageModel.set_context(same token ids, CapsuleStore) + argmax, no HTTP, "
                "on a worker thread as in the server",
                "re-prefill: the same server with --capsule-budget-mb 0 (cached tok always 0)",
                "every server got identical prompt text and tokenized it to the same count (asserted); "
                "weights: the text-speaking copy of the random checkpoint (see bench/serve.py)"]
    if gguf:
        same = sum(all(r["llama_same_reply"]) for r in rows)
        t.notes += [f"llama-cpp: `python -m llama_cpp.server --n_threads {a.threads or 2} --n_threads_batch "
                    f"{a.threads or 2} --n_ctx {a.max_seq_len} --cache true` on a GGUF of the same weights "
                    "(bench/gguf.py's converter), greedy, repeat_penalty 1; the barge-in is a disconnect",
                    f"llama-cpp's greedy reply equal to flashrt's on {same} of {a.turns} turns (its history "
                    "is flashrt's replies: where its own reply differed, its live state does not extend to the next prompt)"]
    else:
        t.notes += ["llama-cpp-python's server: not measured in this run (no --llama-python)"]
    C.print_tables([t])
    print(C.RANDOM_NOTE)
    path = C.write_json("serve", a, info, [t], {"rows": rows, "runs": {
        k: [[{kk: vv for kk, vv in x.items() if kk not in ("prompt", "reply_ids")} if isinstance(x, dict) else x
             for x in d] for d in v] for k, v in runs.items()}}, argv)
    png = plot(rows, Path(a.plot) if a.plot else path.with_suffix(".png"), a)
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
