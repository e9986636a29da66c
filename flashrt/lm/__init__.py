"""The language-model layer, on a Session: token ids in, sampled tokens out.

Rule: lm/ builds on core/ (sessions, copies, graphs), models/ (the loader and the protocol) and
capsules/ (stores); it never imports serve, policy or speech. Its public face is this module:
`load`, `LanguageModel`, `Options`, and the helpers a server or a test needs (speculative
decoding a round at a time: `SpeculativeDecoder`, from `LanguageModel.speculation().decoder()`;
constrained decoding: `Grammar` specs, passed as generate(grammar=) or rt.constrain(), whose
state a session keeps as a `Constraint`).
"""
from __future__ import annotations

from .grammar import Constraint, Grammar, GrammarOptions, Grammars  # noqa: F401
from .graphs import StepGraphs, graph_body_step, static_step, use_graph_bodies  # noqa: F401
from .inputs import common_prefix  # noqa: F401
from .model import HISTORY, LanguageModel, Options  # noqa: F401
from .pool import LanguageModelPool  # noqa: F401
from .speculative import SpeculationTarget, SpeculativeDecoder, Speculator  # noqa: F401


def load(path, options: Options | None = None, **settings) -> LanguageModel:
    """Load a Hugging Face-format checkpoint directory and open a session on it.

    settings: the fields of Options (max_seq_len, prefill_chunk, device, dtype, weights, sessions,
    ...), over `options` when both are given. sessions > 1 pre-allocates (and on CUDA pre-captures)
    that many sessions in total, so fork() never allocates or captures on the hot path."""
    from dataclasses import replace

    from flashrt.models.loader import load_model
    opts = replace(options or Options(), **settings) if settings else (options or Options())
    model = load_model(path, device=opts.device, dtype=opts.dtype, linear_kernel=opts.linear_kernel,
                       weights=opts.weights)
    pool = (LanguageModelPool(lambda p: LanguageModel(model, opts, pool=p), opts.sessions - 1)
            if opts.sessions > 1 else None)
    return LanguageModel(model, opts, pool=pool)
