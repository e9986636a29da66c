"""`flashrt serve`: an OpenAI-compatible HTTP server whose conversations live in capsules.

Layout: protocol.py (wire models, errors), app.py + session_routes.py (thin routes),
engine.py (the stepping worker), text.py (templates, detokenization, stops), tiers.py
(capsule memory + disk), sessions.py (/v1/sessions). Needs the `serve` extra.
"""
from .server import build, main  # noqa: F401
