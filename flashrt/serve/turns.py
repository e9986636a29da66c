"""One request's turn on its sessions: set the context, step tokens, end or cut it short.

The engine's worker calls these; nothing here touches the queue or another job. Greedy
tokens are sent before they run through the model (the step that makes the next logits);
a cancel keeps prompt + delivered tokens and rolls the rest back, recurrent state included.
"""
from __future__ import annotations

import torch


class Turns:
    def __init__(self, tiers, eos, fingerprint, reuse: bool):
        self.tiers, self.eos, self.fingerprint, self.reuse = tiers, set(eos), fingerprint, reuse
        self._pinned: set = set()

    def prefill(self, job) -> None:
        rt, mem = job.choices[0].rt, self.tiers.mem
        computed = 0
        if not self.reuse:
            rt.reset()
            mem = None
        if job.pin and job.pin < len(job.prompt) and mem is not None:
            key = hash(tuple(job.prompt[: job.pin]))
            if key not in self._pinned:
                rt.set_context(job.prompt[: job.pin], store=mem, remember=False)
                computed += job.pin - rt.context_reused
                try:
                    mem.put(rt.snapshot(), pin=True)
                    self._pinned.add(key)
                except ValueError as e:
                    job.post(("warning", f"prefix not pinned: {e}"))
        logits = rt.set_context(job.prompt, store=mem)
        computed += len(job.prompt) - rt.context_reused
        for c in job.choices:
            c.logits = logits        # forks restore the same state: the same logits
        job.cached = len(job.prompt) - computed
        if job.n > 1:                                   # the other choices fork the prompt's capsule
            cap, m = mem.match(job.prompt, self.fingerprint) if mem is not None else (None, 0)
            if m != len(job.prompt):
                cap = rt.snapshot()
            for c in job.choices[1:]:
                c.rt.restore(cap)

    def step(self, job) -> bool:
        """One token per unfinished choice; True when the turn is over (or cancelled)."""
        if job.cancel is not None:
            for c in job.choices:
                if c.finish is None:
                    c.finish = "cancelled"
            return True
        for c in job.choices:
            if c.finish is not None:
                continue
            if len(c.ids) >= job.max_tokens:
                self._end(job, c, "length")
                continue
            tok = self._next(job, c)
            if tok is None:                             # the session is at max_seq_len
                self._end(job, c, "length")
                continue
            c.ids.append(tok)
            if tok in self.eos and not job.ignore_eos:
                self._end(job, c, "stop")
                continue
            self._post_delta(job, c, c.stream.feed(tok), [tok])   # a chunk per token, text or not
            if c.stream.stopped:
                self._end(job, c, "stop", flush=False)
        return all(c.finish is not None for c in job.choices)

    def _next(self, job, c):
        """One token. Greedy sends it before running it through the model (the step that
        makes the next logits), so TTFT is the prefill alone; sampling goes through
        rt.generate (the session's RNG), which runs the token before returning it."""
        rt = c.rt
        if job.temperature == 0.0:
            if c.pending:
                if rt.position >= rt.max_seq_len:
                    return None
                c.logits = rt.decode(c.ids[-1])
            c.pending = True
            return int(torch.argmax(c.logits))         # the sampler's greedy rule, same logits
        out = rt.generate(max_new_tokens=1, temperature=job.temperature, top_p=job.top_p,
                          seed=c.seed if not c.ids else None, ignore_eos=True)
        return out[0] if out else None

    def _post_delta(self, job, c, text, new_ids) -> None:
        job.post(("delta", c.index, text, c.stream.covered() - 1, new_ids))

    def _end(self, job, c, reason, flush=True) -> None:
        if flush:
            text = c.stream.finish()
            if text:
                self._post_delta(job, c, text, [])
        c.finish = reason
        job.post(("finish", c.index, reason, len(c.ids) - 1, list(c.ids)))

    def end(self, job, cancel) -> int:
        """The turn's final history in its sessions; returns the completion token count."""
        if cancel is not None:       # came in before the end, even during the last step
            self._rollback_delivered(job)
        for c in job.choices:        # the history holds every kept id, the last one included
            if c.pending and c.rt.position < len(job.prompt) + len(c.ids):
                c.rt.decode(c.ids[-1])
            c.pending = False
        if job.session is not None:
            job.session.end_turn(job.choices[0].rt.tokens)
        return sum(len(c.ids) for c in job.choices)

    def _keep(self, job, c) -> int:
        kind, vals = job.cancel
        if vals is None:
            return min(job.delivered[c.index], len(c.ids))
        v = vals[c.index]
        return min(v, len(c.ids)) if kind == "tokens" else c.stream.covered(v)

    def _rollback_delivered(self, job) -> None:
        """The sessions hold prompt + delivered tokens: the rest is rolled back."""
        job.kept = []
        for c in job.choices:
            k = self._keep(job, c)
            del c.ids[k:]
            c.pending = c.pending and len(c.ids) == k and c.rt.position < len(job.prompt) + k
            if c.rt.position > len(job.prompt) + k:
                c.rt.rollback(len(job.prompt) + k)      # recurrent state included
            job.kept.append(k)
            if c.finish == "cancelled":
                job.post(("finish", c.index, "cancelled", k - 1, list(c.ids)))

    def truncate(self, job, rt) -> list:
        """A cancel that came after the response finished: rewrite its conversation(s)."""
        kept = []
        for c in job.choices:
            k = self._keep(job, c)
            toks = job.prompt + c.ids[:k]
            if self.reuse:
                rt.set_context(toks, store=self.tiers.mem)
                self.tiers.remember_turn(rt)
            if job.session is not None and c.index == 0:
                job.session.end_turn(toks)
            kept.append(k)
        return kept
