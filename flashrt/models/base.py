"""Everything a model file uses, in one import: the protocol, the arena's buffer spec, the step
context, the NN building blocks and the counter RNG.

    from flashrt.models.base import BufferSpec, CausalLM, Linear, RMSNorm, StepCtx, ...
"""
from __future__ import annotations

from flashrt.core.arena import BufferSpec  # noqa: F401
from flashrt.core.rng import normal  # noqa: F401
from flashrt.core.step import StepCtx  # noqa: F401
from flashrt.nn.layers import (QKNormAttention, RMSNorm, Rotary, SwiGLU, apply_rotary,  # noqa: F401
                               attend_cached, depthwise_causal_conv, rotary_tables, rotate)
from flashrt.nn.linear import Linear, LinearPack, linear  # noqa: F401
from flashrt.nn.linear_attn import (causal_conv, chunk_gated_delta_rule, fast_kernels,  # noqa: F401
                                    gated_delta_block, gated_step_runs, recurrent_gated_delta_rule)

from .causal_lm import CausalLM  # noqa: F401
from .protocol import (InputSpec, PolicyModel, StatefulModel, VadModel, check, check_rope,  # noqa: F401
                       require)
from .protocol import CodecModel, SynthesizerModel  # noqa: F401
from .protocol import TranscriberModel  # noqa: F401
