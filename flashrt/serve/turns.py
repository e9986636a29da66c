"""One request's turn on its sessions: set the context, step tokens, end or cut it short.

The engine's worker calls these; nothing here touches the queue or another job. Greedy
tokens are sent before they run through the model (the step that makes the next logits);
a cancel keeps prompt + delivered tokens and rolls the rest back, recurrent state included.
Every store access goes through the job's namespace (the memory store's view of it): a
prompt is reused only from capsules stored under the same namespace.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

from .events import Delta, Finished
from .wire import APIError


class Turns:
    def __init__(self, store, *, eos, fingerprint, reuse: bool, pin_bytes: int = 0, draft_tokens: int = 0):
        """store: the server's TurnStore. pin_bytes: what pinned prefixes may hold together;
        past it the least recently used pin is released (it stays stored, evictable), so pins
        cannot shut reuse off for all.
        draft_tokens > 0: decode speculatively with the model's draft head (MTP), that many
        drafts a round; every prefill then also writes the head's rows, so capsules carry them."""
        self.store, self.eos, self.fingerprint, self.reuse = store, set(eos), fingerprint, reuse
        self.pin_bytes, self.draft_tokens = pin_bytes, draft_tokens
        self._pins: OrderedDict = OrderedDict()     # (namespace, prefix) -> (store key, bytes), LRU

    def _pin(self, job, rt, mem) -> int:
        """The capsule of the prompt's first job.pin tokens, pinned; returns positions run."""
        prefix = (job.ns, tuple(job.prompt[: job.pin]))
        if prefix in self._pins and self._pins[prefix][0] in mem:
            self._pins.move_to_end(prefix)
            return 0
        self._set_context(rt, list(prefix[1]), mem, remember=False)
        run = job.pin - rt.context_reused
        cap = rt.snapshot()
        size = cap.data.numel()
        while self._pins and sum(b for _, b in self._pins.values()) + size > self.pin_bytes:
            key, _ = self._pins.popitem(last=False)[1]
            if key in self.store.mem:
                self.store.mem.pin(key, False)
        if size > self.pin_bytes:
            warnings.warn(f"flashrt serve: a {job.pin}-token prefix ({size} B) exceeds the pinned "
                          f"capsule budget ({self.pin_bytes} B): not pinned")
            return run
        try:
            self._pins[prefix] = (mem.put(cap, pin=True), size)
        except ValueError as e:
            warnings.warn(f"flashrt serve: prefix not pinned: {e}")
        return run

    def _set_context(self, rt, toks, mem, remember=True):
        advance = rt.speculation().prefill if self.draft_tokens else None
        return rt.set_context(toks, store=mem, remember=remember, advance=advance)

    def set_context(self, rt, toks, ns: str = "") -> None:
        """rt holds toks (restored, rolled back or prefilled from namespace ns's capsules)."""
        self._set_context(rt, list(toks), self.store.view(ns))

    def remember(self, rt, toks, ns: str = "", spill: bool = False):
        """rt holds toks, and their capsule is stored as a turn end (memory, disk copy); spill:
        the disk copy is a spill instead (pinned), whose Future (TurnStore.spill) is returned."""
        self.set_context(rt, toks, ns)
        if spill:
            return self.store.spill(rt.snapshot(), ns)
        self.store.remember_turn(rt, ns)

    def prefill(self, job) -> None:
        rt, mem = job.choices[0].rt, self.store.view(job.ns)
        computed = 0
        if not self.reuse:
            rt.reset()
            mem = None
        if job.pin and mem is not None:
            computed += self._pin(job, rt, mem)
        logits = self._set_context(rt, job.prompt, mem)
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
        grammar, rec = job.decoding.grammar, job.resume
        # the session's grammar state goes on under the same grammar (a JSON cut by a barge-in
        # or a rollback is finished); a restored capsule's grammar record is not this request's
        accepted = rec["ids"] if rec is not None and grammar is not None and rec["key"] == grammar.key else ()
        for c in job.choices:
            con = c.rt.constrain(grammar, accepted)
            if con is not None and con.terminated:      # it was complete: nothing may follow
                self._end(job, c, "stop")
            elif con is not None:
                c.logits = con.mask(logits.clone())     # decode() masks the later ones

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
            toks = self._next_speculative(job, c) if self.draft_tokens else self._next(job, c)
            if not toks:                                # the session is at max_seq_len
                self._end(job, c, "length")
                continue
            for tok in toks:                            # a speculative round: 1 + accepted drafts
                c.ids.append(tok)
                # a grammar allows EOS once complete, and nothing after it: EOS ends it
                if tok in self.eos and (not job.ignore_eos or job.decoding.grammar is not None):
                    self._end(job, c, "stop")
                    break
                self._post_delta(job, c, c.stream.feed(tok), [tok])   # a chunk per token
                if c.stream.stopped:
                    self._end(job, c, "stop", flush=False)
                    break
        return all(c.finish is not None for c in job.choices)

    def _next(self, job, c) -> list:
        """One token. Greedy sends it before running it through the model (the step that
        makes the next logits), so TTFT is the prefill alone; so does sampling steered by a
        bias or logprobs (it draws from the session's RNG here). Plain sampling goes through
        rt.generate (the session's RNG), which runs the token before returning it. Under a
        grammar c.logits are masked (prefill, then decode) and generate masks its own."""
        rt, d = c.rt, job.decoding
        if job.temperature == 0.0 or d.steered:
            if c.pending:
                if rt.position >= rt.max_seq_len:
                    return []
                c.logits = rt.decode(c.ids[-1])
            elif job.temperature > 0.0 and not c.ids:
                rt.seed(c.seed)
            c.pending = True
            return [self._choose(job, c)]
        return rt.generate(max_new_tokens=1, temperature=job.temperature, top_p=job.top_p,
                           seed=c.seed if not c.ids else None, ignore_eos=True, grammar=d.grammar)

    @staticmethod
    def _choose(job, c) -> int:
        """The token from c.logits (V,): biased (after a grammar's mask, which is the same: a
        refused id stays -inf), then the sampler's rule (greedy: argmax, as plain greedy without
        a bias); with logprobs, c.logprob is its log-softmax over these final logits and the
        top alternatives."""
        d, logits = job.decoding, c.logits
        if d.bias:
            ids, vals = zip(*d.bias)
            logits = logits.index_add(0, torch.tensor(ids, device=logits.device),
                                      torch.tensor(vals, dtype=logits.dtype, device=logits.device))
        if job.temperature == 0.0:
            tok = int(torch.argmax(logits))
        else:
            tok = c.rt.sample(job.temperature, 0, job.top_p, logits=logits)
        if d.logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            top = lp.topk(d.logprobs) if d.logprobs else None
            c.logprob = (tok, float(lp[tok]), () if top is None else
                         tuple(zip(top.indices.tolist(), top.values.tolist())))
        return tok

    def _next_speculative(self, job, c) -> list:
        """One round of the choice's speculative decoder: the first token (sent before it runs,
        as greedy is), then per round the accepted drafts and the next token; the last one
        sent is pending until the next round (or end()) runs it."""
        if c.decoder is None:
            if job.temperature > 0.0:
                c.rt.seed(c.seed)
            c.decoder = c.rt.speculation().decoder(self.draft_tokens, job.temperature, 0, job.top_p,
                                                   constraint=c.rt.constraint)
            return [t for t in [c.decoder.first()] if t is not None]
        if c.decoder.pending is None:       # a stop id committed, or the session is full
            return []
        return c.decoder.next(job.max_tokens - len(c.ids), set() if job.ignore_eos else self.eos)

    def _post_delta(self, job, c, text, new_ids) -> None:
        lp = (c.logprob,) if new_ids and c.logprob is not None else ()
        job.post(Delta(c.index, text, c.stream.covered() - 1, tuple(new_ids), lp))

    def _end(self, job, c, reason, flush=True) -> None:
        if flush:
            text = c.stream.finish()
            if text:
                self._post_delta(job, c, text, [])
        c.finish = reason
        job.post(Finished(c.index, reason, len(c.ids) - 1, tuple(c.ids)))

    def end(self, job, cancel) -> int:
        """The turn's final history in its sessions; returns the completion token count."""
        for c in job.choices:        # speculative: run the pending token, write draft-head rows
            if c.decoder is not None:
                c.decoder.close()
                c.decoder = None
        if cancel is not None:       # came in before the end, even during the last step
            self._rollback_delivered(job)
        for c in job.choices:        # the history holds every kept id, the last one included
            kept = len(job.prompt) + len(c.ids)
            if c.pending and c.rt.position < kept:
                c.rt.decode(c.ids[-1])
            elif c.rt.position > kept:      # a speculative round committed past a stop string
                c.rt.rollback(kept)
            c.pending = False
        rt = job.choices[0].rt
        job.outcome = list(rt.tokens)
        if job.conversation is not None:
            job.conversation.end_turn(job.outcome, None if rt.constraint is None else rt.constraint.record())
        return sum(len(c.ids) for c in job.choices)

    def _keep(self, job, c) -> int:
        cut = job.cancel
        if cut.values is None:
            return min(job.delivered[c.index], len(c.ids))
        v = cut.values[c.index]
        return min(v, len(c.ids)) if cut.kind == "tokens" else c.stream.covered(v)

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
                job.post(Finished(c.index, "cancelled", k - 1, tuple(c.ids)))

    def truncate(self, job, rt) -> list:
        """A cancel that came after the response finished (or after an earlier cut: what was
        kept only shrinks, e.g. a disconnect, then what the client says it spoke): rewrite its
        conversation(s). A session is rewritten only while idle and still at this turn's
        outcome (409 if it has moved on)."""
        kept = [self._keep(job, c) for c in job.choices]
        if job.kept is not None:
            kept = [min(a, b) for a, b in zip(kept, job.kept)]
            if kept == job.kept:
                return list(kept)
        if job.conversation is not None:
            toks = job.prompt + job.choices[0].ids[: kept[0]]
            if not job.conversation.replace_if(job.outcome, toks):
                raise APIError(409, f"session {job.conversation.id} has moved on since response "
                               f"{job.id} (a later turn, restore or rollback): not rewritten",
                               code="session_moved_on")
            job.outcome = toks
        for c, k in zip(job.choices, kept):
            if self.reuse:
                self.remember(rt, job.prompt + c.ids[:k], job.ns)
        job.kept = kept
        return kept
