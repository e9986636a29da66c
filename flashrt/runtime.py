"""A session: one arena over shared weights; prefill, decode, sampling, capsules, rollback.

Host-side planning (chunking, bounds, checkpoint boundaries) happens here; the step itself
(`_step`) only touches arena buffers, so it runs eagerly or as a replayed CUDA graph.
"""
from __future__ import annotations

import itertools
import os
import threading
import uuid
import warnings
import weakref
from dataclasses import dataclass

import torch

from flashrt.arena import CAPSULE_KINDS, Arena, BufferSpec
from flashrt.capsules.capsule import (Capsule, CapsuleMeta, ReadOnlyDict, check_fits,
                                      restore_arena, snapshot_arena)
from flashrt.errors import CapsuleError, CapsuleMismatchError
from flashrt.layers import StepCtx
from flashrt.loader import LoadedModel
from flashrt.sampler import sample, seed_rng, validate
from flashrt.version import __version__

_FIXED_NO_RNG = frozenset(("recurrent", "conv", "mtp", "meta"))


@dataclass
class Options:
    max_seq_len: int = 4096
    prefill_chunk: int = 2048         # tokens per eager prefill step (fewer weight passes)
    checkpoint_every: int = 1024      # rollback checkpoints at multiples of this position
    max_checkpoints: int = 16         # memory bound: oldest dropped first
    cuda_graphs: bool = True
    graph_max_tokens: int = 64        # steps up to this many tokens replay graphs; longer run eagerly
    seed: int = 0


def runtime_specs(o: Options, vocab: int) -> list[BufferSpec]:
    """Buffers every session has, whatever the model."""
    return [
        BufferSpec("meta.position", "meta", (1,), torch.int64),
        BufferSpec("meta.logits", "meta", (vocab,), torch.float32),     # logits after the last token
        BufferSpec("meta.tokens", "meta", (o.max_seq_len,), torch.int64, seq_dim=0),
        BufferSpec("sampler.rng", "rng", (2,), torch.int64),            # [seed, counter]
        BufferSpec("io.ids", "io", (o.prefill_chunk,), torch.int64),
        BufferSpec("io.arange", "io", (o.prefill_chunk,), torch.int64),
    ]


class Runtime:
    """One sequence (batch 1). Parallel branches are forks: sessions over the same weights."""

    def __init__(self, model: LoadedModel, options: Options, pool=None):
        self.model, self.options, self._pool = model, options, pool
        self.net = model.net
        specs = self.net.state_specs(options.max_seq_len, model.dtype) + runtime_specs(options, self.net.vocab_size)
        with torch.no_grad():
            self.arena = Arena(specs, model.device)
            self.arena["io.arange"].copy_(torch.arange(options.prefill_chunk))
            seed_rng(self.arena["sampler.rng"], options.seed)
        # fingerprint and provenance are shared, read-only, by every capsule made here: a
        # snapshot copies no dict (each copy costs ~1 us with caches cold after a 1 MiB copy)
        self.fingerprint = ReadOnlyDict(model.fingerprint, layout=self.arena.fingerprint())
        self._lock = threading.RLock()
        # capsule ids "<session token>-<counter>": uuid4 per snapshot costs ~30 us of
        # os.urandom; a chain of C iterators runs no bytecode (an f-string with a format spec
        # costs ~0.6 us hot, more after a copy has evicted the caches)
        self._ids = map(f"{uuid.uuid4().hex[:16]}-".__add__, map(str, itertools.count()))
        self._provenance = ReadOnlyDict(
            device=str(model.device), torch=torch.__version__, flashrt=__version__, pid=os.getpid(),
            linear=model.linear_kernel, threads=torch.get_num_threads())
        self._pos = 0
        self._stepped = 0                          # tokens run through the model, ever
        self.context_reused = 0                    # see set_context
        self._checkpoints: list[Capsule] = []     # fixed state at multiples of checkpoint_every
        # (weakref, id, position) of capsules whose rows equal ours below that position (see
        # _extends). Weak: the session never keeps a capsule's memory the caller let go of.
        self._anchors: list[tuple] = []
        self._has_fixed_state = any(s.spec.kind in ("recurrent", "conv", "mtp")
                                    for s in self.arena.slots)
        self.finish_reason = None
        self.graphs = None
        if options.cuda_graphs and model.device.type == "cuda":
            from flashrt.graphs import StepGraphs
            self.graphs = StepGraphs(self, min(options.graph_max_tokens, options.prefill_chunk))
            self.graphs.capture()
            self.reset()

    # ---- properties -------------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self._pos

    @property
    def max_seq_len(self) -> int:
        return self.options.max_seq_len

    @property
    def tokens(self) -> list[int]:
        with self._lock:
            return self.arena["meta.tokens"][: self._pos].tolist()

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def layout(self) -> str:
        return self.arena.table()

    # ---- the step ---------------------------------------------------------------------------
    def _step(self, ids: torch.Tensor, all_logits: bool = False):
        """Advance by len(ids) tokens (already validated). Returns all-position logits if asked."""
        T, start = ids.shape[0], self._pos
        self._stepped += T
        self._note_threads()
        if self.graphs is not None and not all_logits and T <= self.graphs.max_size:
            self.graphs.run(ids)
            self._pos += T
            return None
        ctx = StepCtx(T, torch.arange(start, start + T, device=ids.device), start=start)
        logits = self.net(ids, ctx, self.arena, all_logits=all_logits)
        self._commit(ids, ctx.positions, logits[-1], start + T)
        self._pos += T
        return logits

    def _note_threads(self) -> None:
        """Provenance records the intra-op thread count of the last step (CPU bits depend on
        it); checked per step, so a snapshot never asks torch."""
        n = torch.get_num_threads()
        if n != self._provenance["threads"]:
            self._provenance = ReadOnlyDict(self._provenance, threads=n)

    def _commit(self, ids, positions, last_logits, new_pos: int | None):
        """Bookkeeping shared by the eager and the captured step (new_pos None: on device)."""
        a = self.arena
        a["meta.logits"].copy_(last_logits)
        a["meta.tokens"].index_copy_(0, positions, ids)
        if new_pos is None:
            a["meta.position"].add_(ids.shape[0])
        else:
            a["meta.position"].fill_(new_pos)

    def _static_step(self, T: int):
        """The graph-captured body: inputs from io.ids, position from meta.position."""
        a = self.arena
        ids = a["io.ids"][:T]
        positions = a["meta.position"] + a["io.arange"][:T]
        logits = self.net(ids, StepCtx(T, positions, static=True), a)
        self._commit(ids, positions, logits[-1], None)

    # ---- host planning ----------------------------------------------------------------------
    def _check_ids(self, ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("empty ids: prefill needs at least one token")
        V = self.net.vocab_size
        for j, i in enumerate(ids):
            if not 0 <= i < V:
                raise ValueError(f"token id {i} at index {j} is outside the vocabulary [0, {V})")
        if self._pos + len(ids) > self.max_seq_len:
            raise ValueError(f"{len(ids)} tokens at position {self._pos} exceed max_seq_len "
                             f"{self.max_seq_len}")
        return torch.tensor(ids, dtype=torch.int64, device=self.model.device)

    def _chunks(self, n: int):
        """Chunk lengths: at most prefill_chunk, split at checkpoint boundaries when the model
        has fixed state to checkpoint (attention-only models rewind by position alone)."""
        pos, every, out = self._pos, self.options.checkpoint_every, []
        while n:
            step = min(n, self.options.prefill_chunk)
            if self._has_fixed_state:
                step = min(step, every - pos % every)
            out.append(step)
            pos, n = pos + step, n - step
        return out

    def _advance(self, ids: torch.Tensor, all_logits: bool):
        outs, i = [], 0
        for n in self._chunks(ids.shape[0]):
            out = self._step(ids[i: i + n], all_logits)
            if all_logits:
                outs.append(out)
            i += n
            self._maybe_checkpoint()
        return torch.cat(outs).float() if all_logits else None

    # ---- public stepping --------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids, all_logits: bool = False) -> torch.Tensor:
        """Append tokens; returns float32 logits of the last position (or of all, shape (T, V))."""
        with self._lock:
            t = self._check_ids(ids)
            out = self._advance(t, all_logits)
            return out if all_logits else self.arena["meta.logits"].clone()

    @torch.no_grad()
    def decode(self, token: int) -> torch.Tensor:
        """Append one token; returns its float32 logits (a fresh tensor, not an arena view)."""
        with self._lock:
            if self._pos == 0:
                raise RuntimeError("decode() before any prefill: the session is empty (position 0)")
            if self._pos >= self.max_seq_len:
                raise ValueError(f"max_seq_len {self.max_seq_len} reached: cannot decode at "
                                 f"position {self._pos}")
            self._advance(self._check_ids([token]), False)
            return self.arena["meta.logits"].clone()

    @torch.no_grad()
    def generate(self, ids=None, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop=(),
                 ignore_eos: bool = False, speculative: str | None = None, draft_tokens: int = 2,
                 drafter=None) -> list[int]:
        """Sample up to max_new_tokens; every returned token is committed to the session.

        seed=None continues the session's RNG stream; an int reseeds it. Stops after EOS (from
        the checkpoint's generation config) or any `stop` id; finish_reason says why it ended.
        speculative="mtp" drafts draft_tokens tokens per step with the checkpoint's MTP layer
        and verifies them in one step ("draft": an injected drafter(rt, k) drafts); see
        flashrt/speculative.py.
        """
        if speculative is not None or drafter is not None:
            from flashrt.speculative import generate as speculative_generate
            return speculative_generate(self, ids, max_new_tokens, temperature, top_k, top_p, seed,
                                        stop, ignore_eos, speculative, draft_tokens, drafter)
        validate(temperature, top_k, top_p)
        with self._lock:
            stops = self._start_generation(ids, seed, stop, ignore_eos, self.prefill)
            out, self.finish_reason = [], "length"
            for _ in range(max_new_tokens):
                if self._pos >= self.max_seq_len:
                    self.finish_reason = "max_seq_len"
                    break
                tok = int(sample(self.arena["meta.logits"], self.arena["sampler.rng"],
                                 temperature, top_k, top_p))
                self._advance(torch.tensor([tok], device=self.model.device), False)
                out.append(tok)
                if tok in stops:
                    self.finish_reason = "stop"
                    break
            return out

    def _start_generation(self, ids, seed, stop, ignore_eos, prefill) -> set:
        """Shared by plain and speculative generate: prefill or require context, reseed, stops."""
        if ids is not None:
            prefill(ids)
        elif self._pos == 0:
            raise RuntimeError("generate() without ids on an empty session: prefill first")
        if seed is not None:
            seed_rng(self.arena["sampler.rng"], seed)
        return set(stop) | (set() if ignore_eos else set(self.model.eos_ids))

    @torch.no_grad()
    def reset(self) -> None:
        """Empty the session: zero fixed state, position 0. The RNG stream continues."""
        with self._lock:
            a = self.arena
            rng = a["sampler.rng"].clone()
            a.data[a.fixed_begin: a.fixed_end].zero_()
            a["sampler.rng"].copy_(rng)
            self._pos = 0
            self._checkpoints.clear()
            self._anchors.clear()

    def seed(self, seed: int) -> None:
        with self._lock, torch.no_grad():
            seed_rng(self.arena["sampler.rng"], seed)

    # ---- capsules -----------------------------------------------------------------------------
    def _capsule_meta(self, single_use: bool = False, parent: dict | None = None) -> CapsuleMeta:
        # every snapshot pays this next to a ~40 us copy at 1 MiB: positional arguments and
        # the session's shared read-only fingerprint and provenance
        return CapsuleMeta(self._pos, self.fingerprint, self._provenance, parent, single_use,
                           {"id": next(self._ids)})

    # no torch.no_grad() on snapshot/restore: they move raw uint8 bytes that autograd never
    # sees, and the decorator costs ~5 us per call on a path measured against a plain copy
    def snapshot(self, into: Capsule | None = None, single_use: bool = False,
                 parent: Capsule | None = None) -> Capsule:
        """Copy the committed state (KV rows [0, position), fixed state, RNG, metadata).

        parent: a capsule this session was restored from (or snapshotted) whose rows it still
        holds unchanged; the result stores only rows [parent.position, position) plus the
        fixed state and references the parent (a shared-prefix capsule).
        """
        with self._lock:
            if into is not None and into.meta.fingerprint is not self.fingerprint:
                self._check_into(into)
            ref = None
            if parent is not None:
                ref = {"id": parent.id, "position": parent.position}
                if not self._extends(ref):
                    raise CapsuleMismatchError(
                        f"snapshot(parent=): this session's state does not extend capsule {parent.id} "
                        "(it was not restored or snapshotted here, or rows below it were rewritten)")
            return self._snapshot(into, single_use, ref, parent)

    def _snapshot(self, into, single_use, ref, parent) -> Capsule:
        meta = self._capsule_meta(single_use, ref)
        cap = snapshot_arena(self.arena, self._pos, meta, into=into, parent=parent)
        a = self._anchors
        if a and a[-1][0]() is cap:           # snapshot(into=) the same capsule again
            a[-1] = (a[-1][0], meta.extra["id"], self._pos)
        else:
            self._add_anchor(cap)
        return cap

    # Anchors: (weakref to capsule, its id, its position) for capsules whose per-token rows
    # equal this session's rows below that position: parents for shared-prefix snapshots and
    # sources for rollback. An id names fixed content (rewriting a capsule gives it a new one),
    # so a dropped capsule still names a stored copy by id, while only live ones are sources.
    def _extends(self, ref: dict) -> bool:
        return bool(ref["id"]) and any(i == ref["id"] and p == ref["position"] <= self._pos
                                       for _, i, p in self._anchors)

    def _anchored(self, position: int) -> list[Capsule]:
        """Live anchored capsules, unchanged since (same id), at or below position."""
        return [c for r, i, p in self._anchors
                if p <= position and (c := r()) is not None and c.id == i]

    def _add_anchor(self, cap: Capsule) -> None:
        self._anchors = ([a for a in self._anchors if a[0]() is not cap][-7:]
                         + [(weakref.ref(cap), cap.id, cap.position)])

    def _drop_anchors_above(self, position: int) -> None:
        """Rows from position on are about to be rewritten: capsules above it stop anchoring."""
        self._anchors = [a for a in self._anchors if a[2] <= position]

    def empty_capsule(self, max_tokens: int | None = None) -> Capsule:
        """A preallocated capsule buffer for snapshot(into=), sized for max_tokens (default: all)."""
        from flashrt.capsules.capsule import plan_entries
        _, need = plan_entries(self.arena, self.max_seq_len if max_tokens is None else max_tokens)
        pin = self.model.device.type == "cpu" and torch.cuda.is_available()
        data = torch.empty(need, dtype=torch.uint8, device=self.model.device, pin_memory=pin)
        return Capsule(data, [], CapsuleMeta(0, self.fingerprint, {}))

    def _check_into(self, cap: Capsule):
        # a capsule holding nothing (a refused load(into=) emptied it) is a plain buffer
        if cap.entries and cap.meta.fingerprint != self.fingerprint:
            raise CapsuleMismatchError("snapshot(into=): that capsule was made by another model/layout")

    def restore(self, cap: Capsule, kinds=None) -> None:
        """Make the session's state the capsule's. kinds: restore only those (+ meta; unsafe)."""
        with self._lock:
            if kinds is not None:
                want = frozenset(kinds) | {"meta"}
                bad = want - CAPSULE_KINDS
                if bad:
                    raise ValueError(f"restore(kinds=): unknown or non-capsule kinds {sorted(bad)}")
            chain = check_fits(cap, self.arena, self.fingerprint, self.max_seq_len)
            if cap.meta.single_use:
                cap.claim()                               # validation first, then consume
            # check_fits refused entries of other kinds: restoring all needs no set algebra
            restore_arena(self.arena, cap, cap._kinds if kinds is None else want & cap._kinds, chain)
            self._pos = cap.meta.position
            if self._checkpoints:
                self._checkpoints.clear()
            # a partial restore leaves a mixed state: nothing may build on it
            self._anchors = ([] if kinds is not None else [(weakref.ref(cap), cap.id, cap.meta.position)]
                             if len(chain) == 1 else [(weakref.ref(c), c.id, c.position) for c in chain])

    @torch.no_grad()
    def set_context(self, tokens, store=None, remember: bool = True) -> torch.Tensor:
        """Make the session's whole context exactly `tokens`; returns the float32 last logits.

        Reuses what is cheapest to reach: the session's own history (extend it, or roll back
        to the common prefix) or the longest prefix stored in `store` (a CapsuleStore:
        restore it, then prefill only the rest). remember: put a capsule of the new boundary
        into `store`, a shared-prefix one over the deepest stored capsule it extends.
        Afterwards `context_reused` is how many of `tokens` were not run through the model
        (restored, kept, or rolled back to), e.g. a server's cached_tokens.
        """
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        toks, V = [int(t) for t in tokens], self.net.vocab_size
        bad = next((j for j, t in enumerate(toks) if not 0 <= t < V), None)
        if not toks or len(toks) > self.max_seq_len or bad is not None:
            raise ValueError(f"set_context: need 1..{self.max_seq_len} token ids in [0, {V}); got "
                             f"{len(toks)}" + (f", id {toks[bad]} at {bad}" if bad is not None else ""))
        with self._lock:
            stepped0 = self._stepped
            n = min(self._pos, len(toks))
            diff = (self.arena["meta.tokens"][:n].cpu() != torch.tensor(toks[:n])).nonzero()
            common = int(diff[0]) if len(diff) else n
            src = self._rollback_source(common) if common < self._pos else None
            own = common if common == self._pos else (src.position if src is not None else 0)
            cap, m = store.match(toks, self.fingerprint) if store is not None else (None, 0)
            if cap is not None and m > own:           # fewer tokens to prefill from the store
                self.restore(cap)
            elif common < self._pos:
                self.rollback(common)
            if self._pos < len(toks):
                self._advance(torch.tensor(toks[self._pos:], device=self.model.device), False)
            self.context_reused = len(toks) - (self._stepped - stepped0)
            if remember and store is not None and m < len(toks):
                # the deepest stored capsule this state extends; the session's own object for
                # it may be gone (anchors are weak): the store resolves the parent by id
                stored = [(p, i, r()) for r, i, p in self._anchors
                          if p <= self._pos and store.key_of(i) is not None]
                p, i, obj = max(stored, key=lambda a: a[0], default=(0, None, None))
                ref = {"id": i, "position": p} if i is not None else None
                try:
                    store.put(self._snapshot(None, False, ref, obj if obj is not None and obj.id == i else None))
                except (ValueError, CapsuleError) as e:   # the context is set; only the memo failed
                    warnings.warn(f"set_context: boundary not remembered: {e}")
            return self.arena["meta.logits"].clone()

    def fork(self, cap: Capsule | None = None, seed: int | None = None) -> "Runtime":
        """An independent session over the same weights, starting from `cap` or the live state.

        The child does not inherit the parent's rollback checkpoints; the capsule it starts from
        serves as its base checkpoint. seed gives it its own sampling stream.
        """
        with self._lock:
            src = cap if cap is not None else self.snapshot()
            child = self._pool.acquire() if self._pool is not None else Runtime(self.model, self.options)
            child.restore(src)
            if seed is not None:
                child.seed(seed)
            return child

    def close(self) -> None:
        """Give a pooled session back to its pool."""
        if self._pool is not None:
            self._pool.release(self)

    # ---- rollback -----------------------------------------------------------------------------
    def _maybe_checkpoint(self):
        every = self.options.checkpoint_every
        if self._pos % every:
            return
        keep = self.options.max_checkpoints
        reuse = self._checkpoints.pop(0) if len(self._checkpoints) >= keep else None
        meta = self._capsule_meta()
        cp = snapshot_arena(self.arena, self._pos, meta, into=reuse, fixed_only=True)
        self._checkpoints.append(cp)

    @torch.no_grad()
    def rollback(self, position: int) -> None:
        """Return to an earlier token boundary of the current history.

        KV is rewound by position (rows below stay valid); fixed state comes from the nearest
        checkpoint, or capsule of this history the caller still holds, at or before `position`,
        and the gap is re-prefilled from the token history.
        The RNG stream is not rewound, so a retry samples afresh.
        """
        with self._lock:
            if not 0 <= position <= self._pos:
                raise ValueError(f"rollback position {position} is outside the history [0, {self._pos}]")
            if position == self._pos:
                return
            history = self.arena["meta.tokens"][:position].clone()
            self._checkpoints = [c for c in self._checkpoints if c.position <= position]
            src = self._rollback_source(position)
            floor = src.position if src is not None else 0     # rows from here are rewritten
            self._drop_anchors_above(floor)
            if src is None:
                self.reset()
            elif isinstance(src, Capsule):
                restore_arena(self.arena, src, _FIXED_NO_RNG)
                self._pos = src.position
            else:                                   # attention-only: just rewind the position
                self._pos = src.position
                self.arena["meta.position"].fill_(src.position)
            if self._pos < position:
                self._advance(history[self._pos: position], False)

    def _rollback_source(self, position: int):
        cands = [c for c in self._checkpoints if c.position <= position]
        cands += self._anchored(position)
        if not self._has_fixed_state and position > 0 and not any(c.position == position for c in cands):
            return _KVOnlyPoint(position - 1)   # attention-only: KV rows are the whole state
        return max(cands, key=lambda c: c.position, default=None)


class _KVOnlyPoint:
    """Rollback source for attention-only models: nothing to copy, re-prefill one token."""
    def __init__(self, position):
        self.position = position


class SessionPool:
    """Sessions allocated (and captured) at load time, handed out by fork()."""

    def __init__(self, model: LoadedModel, options: Options, n: int):
        self._free = [Runtime(model, options, pool=self) for _ in range(n)]
        self._lock = threading.Lock()

    def acquire(self) -> Runtime:
        with self._lock:
            if not self._free:
                raise RuntimeError("no free session for fork(): all pre-allocated sessions are in "
                                   "use; close() a fork or load with a larger sessions=")
            return self._free.pop()

    def release(self, rt: Runtime) -> None:
        rt.reset()
        with self._lock:
            if rt not in self._free:
                self._free.append(rt)
