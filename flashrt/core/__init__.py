"""The core: one arena of named static buffers per session, the session that steps a model over
it and commits positions, the copies between arena and capsule (snapshot, restore, fork,
rollback, park), forks that share an arena, graph capture, the counter RNG, the step context,
the capture checker, and SessionLayer (layer.py: the capsule face every layer on a Session shares).

Rule: the core knows no tokens and no model. It imports capsules/, native/, errors and torch;
never nn, models, lm, policy, speech, serve or dev. A layer above brings its buffers (specs),
its step bodies and, for rollback, how to re-run positions.
"""
