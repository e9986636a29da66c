"""load(compile=True): the graph bodies through torch.compile (inductor), run eagerly on CPU as
CUDA would capture them. Capsules stay byte-exact on the compiled path: a restored session
continues bitwise like the run that never left, and the logits match the eager bodies'."""
from __future__ import annotations

import pytest
import torch

from conftest import state_bytes
from flashrt.lm import use_graph_bodies

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n, seed, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_compiled_bodies_keep_capsules_exact(runtime):
    eager, comp = runtime("qwen3_5"), runtime("qwen3_5", compile=True)   # the same linear kernels
    use_graph_bodies(eager)
    prompt, turn = _ids(8, 1), _ids(4, 2)
    for rt in (eager, comp):
        rt.prefill(prompt)                       # the 8-token body
    cap = comp.snapshot()

    def cont(rt):
        out = [rt.prefill(turn)] + [rt.decode(t) for t in _ids(2, 3)]
        return torch.stack(out), state_bytes(rt)
    first = cont(comp)
    comp.restore(cap)
    again = cont(comp)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert (first[0] - cont(eager)[0]).abs().max() <= 1e-4
    # the compiled path really ran through dynamo (the eager one did not)
    assert hasattr(comp.graphs.fns[8], "_torchdynamo_orig_callable")
    assert not hasattr(eager.graphs.fns[8], "_torchdynamo_orig_callable")


def test_every_step_size_gets_its_own_compiled_entry(ckpt):
    """Dynamo caches compiled frames per code object, at most recompile_limit each: more sizes
    than the limit must each compile, through a code object of their own, without the
    constructor raising that process-wide limit. The limit is lowered to 2 here (4 sizes, up to
    8 tokens, where the default 8 would take 9 sizes and two minutes of compiling)."""
    from torch._dynamo.utils import counters

    from flashrt.lm import LanguageModel, Options
    from flashrt.models.loader import load_model
    with torch._dynamo.config.patch(recompile_limit=2):
        limit = torch._dynamo.config.recompile_limit
        lm = LanguageModel(load_model(ckpt("qwen3_5", "tiny"), dtype="float32"),
                           Options(max_seq_len=64, prefill_chunk=8, graph_max_tokens=8))
        graphs = use_graph_bodies(lm, compile=True)
        assert len(graphs.sizes) == 4 > limit
        assert torch._dynamo.config.recompile_limit == limit            # no process-wide change
        codes = {f._torchdynamo_orig_callable.__code__ for f in graphs.fns.values()}
        assert len(codes) == len(graphs.fns)                              # one code object each
        torch._dynamo.reset()
        counters.clear()
        lm.prefill(list(range(1, 1 + 15)))        # 15 = 8 + 4 + 2 + 1: every size body runs
        assert counters["stats"]["unique_graphs"] >= len(graphs.sizes)
        assert not any("recompile_limit" in k for k in counters["recompiles"]), counters["recompiles"]
