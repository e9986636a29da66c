"""The engine: one worker thread loads the model, owns it and steps every active request in turn.

The event loop never touches a runtime. It submits a Job (bounded queue: a full one is a
429) and reads events from the job's asyncio queue; the worker admits jobs into free
sessions (forks over shared weights, made at start), runs one step per active job per round
(the first step sets the context: restore or roll back, prefill the rest; then one token per
choice), and posts events (events.py) back with call_soon_threadsafe. A cancel is a Cut the
worker reads before its next step: it rolls the session back to prompt + delivered tokens.
Routes reach the model only through the methods here; none hands them a session.

Namespaces (tenants.py): a job and every call carry one. A session remembers the namespace
of the history it holds, and is emptied (reset) before work of another namespace runs on it,
so its leftover history is never reused, or reported in cached_tokens, across namespaces;
admission prefers a session of the job's own namespace.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import threading
import traceback
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from flashrt.lm import common_prefix, load as load_model

from .events import Cancelled, Done, Failed
from .options import ServeOptions
from .text import TextStream, max_token_chars
from .turn_store import TurnStore
from .turns import Turns
from .wire import APIError

_RECENT = 512            # finished jobs kept so a late cancel still finds its conversation


@dataclass
class Choice:
    index: int
    stream: TextStream
    seed: int
    rt: object = None
    ids: list = field(default_factory=list)
    finish: str | None = None
    logits: object = None         # greedy: logits of the last committed token
    pending: bool = False         # greedy: ids[-1] is sent but not yet run through the model
    decoder: object = None        # speculative: the turn's round-at-a-time decoder
    logprob: tuple | None = None  # Decoding.logprobs: the last token's (id, logprob, top pairs)


@dataclass(frozen=True)
class Decoding:
    """What a request asks of token choice beyond temperature and top_p (serve/replies.py makes
    it). grammar: a flashrt.lm.Grammar every token must follow (from where the prompt ends);
    bias: ((token id, bias), ...) added to the logits; logprobs: None (off) or how many top
    alternatives to report with each chosen token's log-probability."""
    grammar: object = None
    bias: tuple = ()
    logprobs: int | None = None

    @property
    def steered(self) -> bool:
        """Tokens are chosen from the session's logits by the turn (a bias or logprobs asked)."""
        return bool(self.bias) or self.logprobs is not None


@dataclass(frozen=True)
class Cut:
    """A cancel: keep per choice what was delivered. values: one per choice, what the client
    says it received (tokens or characters, by kind); None: what the stream handed out."""
    kind: str = "tokens"            # "tokens" | "chars"
    values: tuple | None = None


@dataclass(frozen=True)
class Cancellation:
    """Engine.cancel's answer. kept: a Future of, per choice, how many generated tokens the
    conversation keeps; done at once unless the worker still has to apply the cut."""
    id: str
    kept: concurrent.futures.Future


@dataclass
class Job:
    id: str
    prompt: list
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stops: list
    post: object                  # callable(event): thread-safe hand-off to the event loop
    pin: int = 0                  # leading prompt tokens whose capsule is pinned
    ignore_eos: bool = False
    decoding: Decoding = field(default_factory=Decoding)
    tenant: str = ""              # who may cancel it (tenants.py)
    ns: str = ""                  # the namespace its prompt is reused from and stored in
    conversation: object = None   # conversations.Conversation the turn belongs to
    # a session turn appending nothing: the session's grammar state (Constraint.record()),
    # continued when the turn's grammar is the same (turns.py)
    resume: dict | None = None
    choices: list = field(default_factory=list)
    cached: int = 0
    phase: str = "queued"         # queued -> running -> (ending ->) done
    cancel: Cut | None = None
    delivered: list = field(default_factory=list)   # per choice, tokens the client received
    kept: list | None = None                        # per choice, after a cancel
    outcome: list | None = None                     # the history the turn left (choice 0)
    # per choice, the tokens its conversation keeps; set once the job is done
    ended: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Engine:
    def __init__(self, options: ServeOptions, *, model_dir):
        """Load model_dir with options.lm (options.max_sessions sessions) on a worker thread of
        its own, which then does all the model's work: with torch's OpenMP, a second thread's
        team (the main thread's, from loading) makes libgomp throttle both teams' spin-waits."""
        self.options = options
        self.model_dir = model_dir
        self.reuse = options.budget_bytes > 0      # 0: every prompt prefilled in full (a baseline)
        self._waiting: deque = deque()
        self._active: list = []
        self._jobs: OrderedDict = OrderedDict()       # id -> Job, active and recent
        self.jobs: dict = {}                          # tenant -> jobs accepted: model calls made
        self._calls: deque = deque()                  # (fn(rt), Future, namespace) run on a free session
        self._held: dict = {}                         # id(session) -> namespace of its history
        self._taken: list = []                        # calls given a session this round, not yet run
        self._cv = threading.Condition()
        self._stop = self._closed = False
        self.error: str | None = None
        self._store: TurnStore | None = None
        self._shared = None
        if options.capsule_redis:          # a fleet-shared tier below this server's own
            from flashrt.capsules.redis_tier import RedisTier
            self._shared = RedisTier.from_url(options.capsule_redis)
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="flashrt-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()
            if self._store is not None:
                self._store.close()
            elif self._shared is not None:
                self._shared.close()
            raise self._load_error

    def _setup(self) -> None:
        o = self.options
        if o.threads:                # torch's OpenMP thread count is per calling thread
            import torch
            torch.set_num_threads(o.threads)
        rt = load_model(self.model_dir, o.lm)
        if o.draft_tokens and not rt.net.has_draft_head:
            raise ValueError(f"--draft-tokens {o.draft_tokens}: {rt.model.path} has no draft head "
                             "(MTP weights); serve it with --draft-tokens 0")
        self.tokenizer = rt.tokenizer
        self.vocab = rt.model.net.vocab_size
        self.max_seq_len = rt.max_seq_len
        # text longer than this many characters cannot fit: refused before it is tokenized
        self.max_text_chars = rt.max_seq_len * max_token_chars(rt.tokenizer, self.vocab)
        self._store = TurnStore(o.budget_bytes, o.capsule_dir, self._shared, o.disk_bytes,
                                o.named_bytes, o.max_named_per_key)
        # pinned prefixes hold at most half the budget: the other half stays for turns
        self.turns = Turns(self._store, eos=rt.model.eos_ids, fingerprint=rt.fingerprint, reuse=self.reuse,
                           pin_bytes=o.budget_bytes // 2, draft_tokens=o.draft_tokens)
        # arenas of their own (captured once, here): n-way requests step them token by token
        self.models = [rt] + [rt.fork(share=False) for _ in range(o.max_sessions - 1)]
        self.free = list(self.models)

    # ---- called from the event loop ------------------------------------------------------
    def submit(self, job: Job) -> None:
        if job.n > len(self.models):
            raise APIError(400, f"n={job.n} exceeds the server's sessions ({len(self.models)})", param="n")
        with self._cv:
            if self._stop or self.error:
                raise APIError(503, f"engine unavailable: {self.error or 'shutting down'}",
                               type="server_error", headers={"Retry-After": "5"})
            # refused only if it must wait (no free session left for it) and the queue is full
            promised = sum(j.n for j in self._waiting)
            limit = self.options.queue_limit
            if len(self.free) - promised < job.n and len(self._waiting) >= limit:
                raise APIError(429, f"queue full ({limit} waiting requests): retry later",
                               type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            job.delivered = [0] * job.n
            self._waiting.append(job)
            self._jobs[job.id] = job
            self.jobs[job.tenant] = self.jobs.get(job.tenant, 0) + 1
            self._cv.notify()

    def job(self, rid: str, tenant: str | None = None) -> Job:
        """The job `rid` (of `tenant`, when given: another tenant's is not found)."""
        with self._cv:
            job = self._jobs.get(rid)
        if job is None or tenant is not None and job.tenant != tenant:
            raise APIError(404, f"no response with id {rid!r} (unknown, or too old)",
                           code="response_not_found", param="response_id")
        return job

    def cancel(self, rid: str, kind: str = "tokens", values=None) -> Cancellation:
        """Stop a response and keep only what was delivered (values: see Cut). Works after it
        finished, too: its conversation is rewritten then (a 409 when it has moved on)."""
        job = self.job(rid)
        with self._cv:
            if job.phase == "queued":
                self._waiting.remove(job)
                job.kept = [0] * job.n
                if job.conversation is not None:
                    job.conversation.end_turn(None)
                job.post(Cancelled())
                self._settle(job, job.kept)
                return Cancellation(rid, job.ended)
            if job.kept is not None and values is None:   # cut already; a bare disconnect
                return Cancellation(rid, _resolved(list(job.kept)))     # adds nothing
            if job.cancel is not None and values is None:  # a cut is pending: a disconnect after
                return Cancellation(rid, job.ended)         # it must not widen it to all sent
            job.cancel = Cut(kind, None if values is None else tuple(values))
            if job.phase == "running":              # the worker applies it before the job ends
                return Cancellation(rid, job.ended)
        return Cancellation(rid, self.call(lambda rt: self.turns.truncate(job, rt), job.ns))

    def has_turn(self, conversation) -> bool:
        """Whether a queued or running job is a turn of `conversation`."""
        with self._cv:
            return any(j.conversation is conversation for j in (*self._waiting, *self._active))

    def remember(self, tokens, ns: str = "", spill: bool = False) -> concurrent.futures.Future:
        """Store the capsule of `tokens` in namespace ns for reuse (restored or prefilled on a
        free session); nothing to do for none. spill: a full copy pinned on disk instead of a turn
        file (its Future is TurnStore.spill's). Raises ValueError on input the model refuses."""
        tokens = list(tokens)
        return self.call(lambda rt: self.turns.remember(rt, tokens, ns, spill) if tokens else None, ns)

    def retain(self, tokens, ns: str = "", keep: bool = True) -> concurrent.futures.Future:
        """Pin (keep) or unpin the memory store's capsule of exactly `tokens` (namespace ns), so
        eviction cannot drop it (nor its delta parents); stored again first when it is gone. The
        Future gives the bytes it keeps, parents included (0 when it cannot be stored: reuse is
        off, or it does not fit)."""
        tokens = list(tokens)

        def fn(rt):
            view = self._store.view(ns)
            cap, n = view.match(tokens, self.turns.fingerprint)
            if keep and self.reuse and (cap is None or n != len(tokens)):
                self.turns.remember(rt, tokens, ns)
                cap, n = view.match(tokens, self.turns.fingerprint)
            key = view.key_of(cap.id) if cap is not None and n == len(tokens) else None
            if key is None:
                return 0
            view.pin(key, keep)
            size = 0
            while cap is not None:
                size, cap = size + cap.nbytes, cap.parent_capsule
            return size
        return self.call(fn, ns)

    def compile_grammar(self, grammar) -> None:
        """Compile a flashrt.lm.Grammar for this model now (off the worker; the sessions share
        the compiled grammars by key), so a refused one is the request's 400 (naming what it
        refused) before it queues, and a 501 without xgrammar."""
        try:
            self.models[0].grammars.compile(grammar)
        except ValueError as e:
            raise APIError(400, f"{grammar.kind} grammar refused: {e}", param="response_format"
                           if grammar.kind != "tool_calls" else "tools", code="unsupported_schema") from None
        except ImportError as e:
            raise APIError(501, str(e), type="server_error", code="grammar_unavailable") from None

    @property
    def can_save_named(self) -> bool:
        """Whether save / load_saved work (the server has a capsule directory)."""
        return self._store.named is not None

    def save(self, tokens, name: str, overwrite: bool = False, tenant: str = "",
             ns: str = "") -> concurrent.futures.Future:
        """The state of `tokens` (namespace ns) on disk under `name` of `tenant`; the Future
        gives its position, or raises FileExistsError when the name is taken (and not
        overwrite), capsules.named.NamedLimitError past a limit."""
        tokens = list(tokens)

        def fn(rt):
            self.turns.set_context(rt, tokens, ns)
            return self._store.save_named(rt, name, tenant, overwrite)
        return self.call(fn, ns)

    def load_saved(self, name: str, tenant: str = "", ns: str = "") -> concurrent.futures.Future:
        """The tokens `tenant` saved under `name` (its capsule goes into memory, namespace ns,
        for reuse); the Future raises KeyError for an unknown name, CapsuleMismatchError for
        another model's save, CapsuleCorruptError for a damaged one (moved aside)."""
        fp = self.turns.fingerprint
        return self.call(lambda rt: self._store.load_named(name, tenant, ns, fp), ns)

    def new_session(self):
        """A language-model session of its own over the loaded weights (options.lm, one
        session), for a caller that steps it on its own thread (voice_session.py); it shares
        nothing with the engine's sessions but the weights."""
        from dataclasses import replace

        from flashrt.lm import LanguageModel
        return LanguageModel(self.models[0].model, replace(self.options.lm, sessions=1))

    def call(self, fn, ns: str = "") -> concurrent.futures.Future:
        """Run fn(session) on the worker when a session is free, the session holding nothing
        of another namespace than ns; returns a Future. For the engine's own methods and
        tests: a route never gets a session."""
        fut = concurrent.futures.Future()
        with self._cv:
            if self._stop or self.error:
                raise APIError(503, "engine unavailable", type="server_error", headers={"Retry-After": "5"})
            self._calls.append((fn, fut, ns))
            self._cv.notify()
        return fut

    def close(self) -> None:
        """Stop the worker and flush the capsule tiers (disk writer, fleet tier); idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)
        self._store.close()

    # ---- worker --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._setup()
        except BaseException as e:                      # noqa: BLE001 (re-raised by __init__)
            self._load_error = e
            return
        finally:
            self._ready.set()
        self._loop()

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._active or self._calls and self.free
                               or self._waiting and len(self.free) >= self._waiting[0].n):
                        self._cv.wait()
                    if self._stop:
                        return
                    # each call takes its session now (admission cannot), kept where a
                    # dying worker's _fail_all finds it until it has run
                    calls = self._taken = []
                    while self._calls and self.free:
                        calls.append((*self._calls.popleft(), self.free.pop()))
                    admitted = self._admit()
                for fn, fut, ns, rt in calls:
                    self._run_call(fn, fut, ns, rt)
                self._taken = []
                for job in admitted:
                    self._guard(job, self.turns.prefill)
                for job in list(self._active):
                    if job.phase == "running":
                        self._guard(job, self._step)
        except BaseException as e:                      # noqa: BLE001 (report, fail, then 503)
            traceback.print_exc()                       # the server log; clients get the type
            self.error = f"engine worker died: {type(e).__name__}: {e}"
            self._fail_all()
            raise

    def _fail_all(self) -> None:
        """The worker is gone: every queued, running and requested piece of work fails now
        (a 503), rather than waiting for a worker that will not come."""
        err = APIError(503, f"engine unavailable: {self.error}", type="server_error",
                       headers={"Retry-After": "5"})
        with self._cv:
            jobs = list(self._waiting) + list(self._active)
            calls = [(fn, fut) for fn, fut, _, _ in self._taken] + [c[:2] for c in self._calls]
            self._waiting.clear()
            self._active.clear()
            self._calls.clear()
        for job in jobs:
            job.post(Failed(err))
            if job.conversation is not None:
                job.conversation.end_turn(None)
            self._settle(job, [0] * job.n)
        for _, fut in calls:
            if not fut.done():          # one taken this round may have run before the death
                fut.set_exception(err)

    def _enter(self, rt, ns: str) -> None:
        """rt is about to run work of namespace ns: emptied first if it holds another's."""
        if self._held.get(id(rt), "") != ns:
            rt.reset()
            self._held[id(rt)] = ns

    def _run_call(self, fn, fut, ns, rt) -> None:
        try:
            if fut.set_running_or_notify_cancel():      # False: its caller stopped waiting
                try:
                    self._enter(rt, ns)
                    fut.set_result(fn(rt))
                except BaseException as e:              # noqa: BLE001 (handed to the caller)
                    fut.set_exception(e)
        finally:
            with self._cv:
                self.free.append(rt)

    def _admit(self) -> list:
        out = []
        while self._waiting and len(self.free) >= self._waiting[0].n:
            job = self._waiting[0]          # left queued until it has sessions (_fail_all)
            rts = self._pick(job.prompt, job.n, job.ns)
            self._waiting.popleft()
            for c, rt in zip(job.choices, rts):
                self._enter(rt, job.ns)
                c.rt = rt
            job.phase = "running"
            self._active.append(job)
            out.append(job)
        return out

    def _pick(self, prompt: list, n: int, ns: str = "") -> list:
        """Free sessions: those holding namespace ns's history first, the one whose history
        shares the longest prefix first (another namespace's history counts as nothing)."""
        def score(rt):
            mine = self._held.get(id(rt), "") == ns
            return (mine, common_prefix(rt.tokens, prompt) if mine else 0)
        best = sorted(self.free, key=score, reverse=True)[:n]
        for rt in best:
            self.free.remove(rt)
        return best

    def _guard(self, job: Job, fn) -> None:
        try:
            fn(job)
        except Exception as e:                          # noqa: BLE001 (one request fails, not all)
            status = 400 if isinstance(e, ValueError) else 500
            job.post(Failed(APIError(status, f"{type(e).__name__}: {e}",
                                     type="invalid_request_error" if status == 400 else "server_error")))
            if job.conversation is not None:
                job.conversation.end_turn(None)
            self._release(job, remember=False)

    def _step(self, job: Job) -> None:
        if self.turns.step(job):
            self._finish(job)

    def _finish(self, job: Job) -> None:
        with self._cv:               # from here a cancel() finds the job ending and truncates after
            job.phase = "ending"
            cancel = job.cancel
        completion = self.turns.end(job, cancel)
        self._release(job, remember=True)
        job.post(Done(len(job.prompt), completion, job.cached))

    def _release(self, job: Job, remember: bool) -> None:
        with self._cv:
            if job in self._active:
                self._active.remove(job)
            job.phase = "done"
        for c in job.choices:
            if c.rt is None:
                continue
            if remember and self.reuse:
                self._store.remember_turn(c.rt, job.ns)
            with self._cv:
                self.free.append(c.rt)
            c.rt = None
        if job.kept is not None:
            kept = list(job.kept)
        else:                        # ended whole, or failed: then nothing of it stays
            kept = [len(c.ids) for c in job.choices] if remember else [0] * job.n
        self._settle(job, kept)
        with self._cv:
            while len(self._jobs) > _RECENT and next(iter(self._jobs.values())).phase == "done":
                self._jobs.popitem(last=False)

    @staticmethod
    def _settle(job: Job, kept: list) -> None:
        job.phase = "done"
        if not job.ended.done():
            job.ended.set_result(kept)


def _resolved(value) -> concurrent.futures.Future:
    fut = concurrent.futures.Future()
    fut.set_result(value)
    return fut


async def wait(fut: concurrent.futures.Future):
    """An engine Future's result, awaited on the event loop. Shielded: a route that stops
    waiting must not cancel a Future the worker (or another route) still resolves."""
    return await asyncio.shield(asyncio.wrap_future(fut))


def new_seed() -> int:
    return secrets.randbits(62)
