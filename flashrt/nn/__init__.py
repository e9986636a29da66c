"""Building blocks a model file uses: projection matmuls with their kernel choice (linear.py),
norms, rotary embedding, attention over arena KV and causal convolution (layers.py), and
Gated DeltaNet linear attention (linear_attn.py).

Rule: nn/ imports core.step (the step context), native/, kernels/ and torch; never capsules,
models, lm, policy, serve or dev. Blocks read and write arena views they are handed; they never
allocate state.
"""
