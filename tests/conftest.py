"""The shared tiny-config runner: every model family goes through the same fixtures and checks."""
from __future__ import annotations

import pytest
import torch

import flashrt
from flashrt.models.checkpoint import make_checkpoint

def _available_archs():
    import importlib.util
    return [a for a in ("qwen3", "qwen3_5", "lfm2")
            if importlib.util.find_spec(f"flashrt.models.{a}") is not None]


ARCHS = _available_archs()
HYBRID = [a for a in ARCHS if a != "qwen3"]


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """ckpt(arch, size="tiny", **kw) -> path of a random-weight checkpoint, made once per session."""
    made = {}

    def get(arch, size="tiny", **kw):
        key = (arch, size, tuple(sorted(kw.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}-{size}")
            made[key] = make_checkpoint(arch, size, out, **kw)
        return made[key]
    return get


@pytest.fixture(scope="session")
def runtime(ckpt):
    """runtime(arch, **load_kwargs) -> a fresh CPU fp32 runtime over a tiny checkpoint."""
    def get(arch, size="tiny", ckpt_kw=None, **kw):
        kw.setdefault("max_seq_len", 256)
        kw.setdefault("dtype", "float32")
        return flashrt.load(ckpt(arch, size, **(ckpt_kw or {})), **kw)
    return get


def hf_reference(path, dtype=torch.float32):
    """transformers' own model for a checkpoint directory (the parity reference)."""
    import json
    from transformers import AutoModelForCausalLM
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") == "qwen3_5":
        from transformers import Qwen3_5ForConditionalGeneration as cls
    else:
        cls = AutoModelForCausalLM
    return cls.from_pretrained(str(path), dtype=dtype).eval()


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_cached_step(model, ids, cache=None):
    """One cached forward of transformers' model: (logits (T, V), cache). transformers >= 5.2x
    names the cache argument `cache`; earlier 5.x (5.17 on the GPU image) `past_key_values`."""
    import inspect
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True, **({name: cache} if cache is not None else {}))
    new = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
    assert new is not None, f"{type(model).__name__} returned no cache"
    return out.logits[0], new


def margin_check(ref_logits: torch.Tensor, tokens, margin=1e-3):
    """Greedy identity under the top-2 margin rule: returns (mismatches, smallest gap met).

    ref_logits[i] are the reference's logits that produced tokens[i]; a position counts only
    where the reference's top-2 gap exceeds `margin` (exact ties are excluded, not hidden).
    """
    top2 = ref_logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1])
    ref_tok = ref_logits.argmax(-1)
    bad = [(i, int(ref_tok[i]), int(t), float(gaps[i])) for i, t in enumerate(tokens)
           if gaps[i] > margin and int(ref_tok[i]) != int(t)]
    return bad, float(gaps.min())


def teacher_forced(rt, last_logits, tokens) -> torch.Tensor:
    """rt's logits along `tokens` from its current state, (len(tokens), V): row 0 is
    last_logits (what its history ends with), row i what rt.decode(tokens[i-1]) gives, so row
    i is what a greedy run on rt would have chosen tokens[i] from."""
    rows = [last_logits.detach().reshape(1, -1).float().clone()]
    rows += [rt.decode(t).reshape(1, -1).float() for t in tokens[:-1]]
    return torch.cat(rows)


def assert_greedy_matches(ref_logits, tokens, margin=1e-3, what=""):
    """Cross-path greedy identity: `tokens` (one path's greedy continuation) are the argmax of
    ref_logits (the other path's logits, teacher-forced along `tokens`) wherever its top-2 gap
    exceeds margin; at least half the positions must be that decisive, so the check cannot go
    vacuous."""
    assert len(tokens) == ref_logits.shape[0] > 0, (what, len(tokens), ref_logits.shape)
    bad, _ = margin_check(ref_logits, tokens, margin)
    assert not bad, f"{what}: greedy tokens differ where the reference is decisive: {bad}"
    top2 = ref_logits.topk(2, dim=-1).values
    decisive = int((top2[:, 0] - top2[:, 1] > margin).sum())
    assert 2 * decisive >= len(tokens), f"{what}: only {decisive}/{len(tokens)} positions decisive"


def state_bytes(rt) -> torch.Tensor:
    """The committed state as bytes: fixed range + live rows of every per-token buffer (a
    shared-arena fork takes its turn first)."""
    a = rt.activate().arena if hasattr(rt, "activate") else rt.arena
    parts = [a.data[a.fixed_begin: a.fixed_end]]
    parts += [a.bytes_of(s.name, rt.position) for s in a.slots
              if s.spec.seq_dim == 0 and s.spec.kind != "io"]
    return torch.cat(parts).clone()


def race(n: int, attempt) -> list:
    """Start attempt(i) for i in range(n) on n threads released together; per thread the string
    attempt returned ("ok" when it returned anything else), or "consumed" for
    CapsuleConsumedError."""
    import threading
    results, barrier = [None] * n, threading.Barrier(n)

    def go(i):
        barrier.wait()
        try:
            out = attempt(i)
            results[i] = out if isinstance(out, str) else "ok"
        except flashrt.CapsuleConsumedError:
            results[i] = "consumed"
    ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: two OpenMP threads only contend. A module
    opts in with pytestmark = pytest.mark.usefixtures("one_thread")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
