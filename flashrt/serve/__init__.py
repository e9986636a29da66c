"""`flashrt serve`: an OpenAI-compatible HTTP server whose conversations live in capsules.

Rule: HTTP only. serve/ reaches the runtime through the public faces of flashrt.lm and
flashrt.capsules (and errors); it never imports core, nn, models, native, policy or dev.

Layout: protocol.py (wire models, errors), app.py + session_routes.py (thin routes),
engine.py (the stepping worker), text.py (templates, detokenization, stops), tiers.py
(capsule memory + disk), sessions.py (/v1/sessions). Needs the `serve` extra.
"""
from .server import build, main  # noqa: F401
