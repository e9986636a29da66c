"""Text in and out: chat templates, incremental UTF-8 detokenization, stop strings.

Chat template: the checkpoint's own (tokenizer_config.json "chat_template", or a
chat_template.jinja file) rendered with jinja2 in a sandbox, as transformers does. A checkpoint
without one gets the PLAIN template, one line per message and an open assistant line:

    system: You are terse.\\n
    user: Hi\\n
    assistant: <generation starts here>

so a rendered history is "<role>: <content>\\n" per message. A checkpoint without tokenizer
files gets flashrt's byte-level tokenizer (ids 0..255 are UTF-8 bytes, other ids decode
to "<id>"), so with random weights the text is meaningless but every byte round-trips.
"""
from __future__ import annotations

import json
from pathlib import Path

PLAIN = "plain"


class ChatTemplate:
    def __init__(self, model_dir):
        d = Path(model_dir)
        cfg, src = {}, None
        if (d / "tokenizer_config.json").exists():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            src = cfg.get("chat_template")
            if isinstance(src, list):     # [{name, template}]: take "default"
                src = next((t["template"] for t in src if t.get("name") == "default"), None)
        if src is None and (d / "chat_template.jinja").exists():
            src = (d / "chat_template.jinja").read_text()
        self.kind = "checkpoint" if src else PLAIN
        self._special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token")}
        self._tpl = None
        if src:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise TemplateError(msg)
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = raise_exception
            self._tpl = env.from_string(src)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages: [{"role", "content"}] -> prompt text. Raises ValueError on a template error."""
        if self._tpl is None:
            out = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return out + ("assistant: " if add_generation_prompt else "")
        from jinja2.exceptions import TemplateError
        try:
            return self._tpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self._special)
        except TemplateError as e:
            raise ValueError(f"chat template refused the messages: {e}") from None


def _token_text(t):
    return t.get("content") if isinstance(t, dict) else t


class TextStream:
    """Generated ids -> text deltas that never split a character and never show a stop string.

    Text becomes stable once the ids decoded so far end on a whole character (byte-level
    tokenizers decode by concatenation). ends[k] is the length of the stable text once token k
    is complete (None while it is not): what `delivered_chars` is mapped back through.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""            # stable text of all complete tokens
        self.sent = 0             # chars of self.text handed out
        self.ends: list = []
        self._base = 0            # first id not yet part of self.text
        self.stopped = False

    def feed(self, tok: int) -> str:
        """Add one generated id; returns the text that may be sent now ("" if none)."""
        self.ids.append(tok)
        self.ends.append(None)
        piece = self.tok.decode(self.ids[self._base:])
        if not piece.endswith("\ufffd") or len(self.ids) - self._base >= 8:
            self.text += piece    # 8 ids without a whole character: not UTF-8, let it out
            for k in range(self._base, len(self.ids)):
                self.ends[k] = len(self.text)
            self._base = len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: flush text held back for a partial stop-string match."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        text, start = self.text, self.sent
        cut = min((i for i in (text.find(s, max(0, start - len(s) + 1)) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.sent = text[start:max(cut, start)], max(cut, start)
            return out
        hold = 0 if final else max((k for s in self.stops for k in range(1, len(s))
                                    if text.endswith(s[:k])), default=0)
        end = max(start, len(text) - hold)
        self.sent = end
        return text[start:end]

    def covered(self, chars: int | None = None) -> int:
        """How many leading tokens have their text wholly inside the first `chars` characters
        of the text sent (default: all of it)."""
        limit = self.sent if chars is None else min(chars, self.sent)
        n = 0
        for e in self.ends:
            if e is None or e > limit:
                break
            n += 1
        return n
