"""The core: one arena of named static buffers per session, the session that steps a model over
it and commits positions, the copies between arena and capsule (snapshot, restore, fork,
rollback, park), forks that share an arena, graph capture, the counter RNG, the step context
and the capture checker.

Rule: the core knows no tokens and no model. It imports capsules/, native/, errors and torch;
never nn, models, lm, policy, speech, serve or dev. A layer above brings its buffers (specs),
its step bodies and, for rollback, how to re-run positions.
"""
