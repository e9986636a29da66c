"""`flashrt serve`: an OpenAI-compatible HTTP server whose conversations live in capsules.

Rule: HTTP only. serve/ reaches the runtime through the public faces of flashrt.lm,
flashrt.capsules, flashrt.speech, flashrt.chat and flashrt.voice (and errors); it never imports
core, nn, models, native, policy or dev.

Layout: options.py (ServeOptions: every setting, once), server.py (build, the command line),
wire.py (request models, responses, errors), chat_wire.py (chat requests: messages, tools,
response formats), replies.py (a chat reply: tool calls, reasoning, grammar, logprobs),
app.py + session_routes.py (thin routes), responses_wire.py + responses.py (/v1/responses
over the chat reply path), response_index.py + response_store.py (the durable id-to-history
index of stored responses and chat completions, their held capsules, /v1/flashrt/retain), idempotency.py (the Idempotency-Key header:
exactly-once chat and responses calls, records shared through --capsule-redis), single_use.py
(consume-once continuations of a response made with flashrt.single_use),
events.py (what the worker posts to a request), engine.py (the stepping worker), turns.py (one
request's turn), text.py (templates, detokenization, stops), turn_store.py (TurnStore: capsule
memory + disk), conversations.py (Conversation: a /v1/sessions history),
guard.py (what every request passes: API keys, Host/Origin/content type, size and time limits),
tenants.py (API keys as tenants, capsule namespaces), audio.py, realtime.py and
audio_wire.py (speech in: the recognizer's routes, with --asr-model), speech.py, speech_wire.py,
voices.py and stretch.py (speech out: /v1/audio/speech, named voices and `speed`, with
--tts-model), voice_session.py and voice_wire.py (the voice agent at the /v1/voice WebSocket,
with --max-voice-sessions), workers.py (LeaseWorker: a speech model's sessions leased to
requests). Needs the `serve` extra.
"""
from .server import build, main  # noqa: F401
