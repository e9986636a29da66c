"""VoiceAgent: a full-duplex voice session over a language model, a streaming recognizer, a VAD
and a synthesizer, driven by the caller: push(pcm) -> events, played(samples).

A turn: the VAD's end of speech forks the recognizer for the final transcript at once
(endpoint(); the live stream goes on untouched). The reply starts preemptively from the
conversation's capsule; while the endpointing window lasts (VoiceOptions.endpointing_ms) it is
prepared but not released. If the user goes on speaking, the next end of speech gives a new
final transcript: the same text keeps the reply's tokens, another text drops them with a restore
(no re-prefill) and starts again. Once released, the reply streams sentence by sentence from the
voice capsule, lead_ms ahead of what was played. Speech over the reply is a barge-in: the
synthesizer rolls back to the last played frame and says how much text that covers, the
language model rolls back to the tokens of that text (recurrent state included), and the
conversation holds exactly what the user heard; the next turn appends to it.

Audio is processed in pieces on the VAD's chunk grid, so turn boundaries and timings do not
depend on how the caller splits its pushes. Scheduling, on one thread: a prepared reply is
released as soon as the VAD allows (the recognizer takes silence in the endpointing window after
it), and past its first audio the reply waits while the agent lags the microphone. Playback: without played() reports the speaker is
taken to play the reply in real time with the input (an underrun waits for audio); after the
first report the caller's figures are used.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from flashrt.capsules import Capsule
from flashrt.chat import ChatTemplate, ReplyParser
from flashrt.lm import LanguageModel
from flashrt.speech import (IncrementalSpeaker, SpeechStart, StreamingTranscriber, Synthesizer,
                            VoiceActivity)

from .events import (STAGES, BargeIn, FinalTranscript, PartialTranscript, SpeechStarted,
                     SpeechStopped, TurnDone, TurnTimings)
from .options import VoiceOptions
from .reply import Reply
from .text import Detokenizer, sentence_rule, tokenize_with_ends, turn_prompt


@dataclass
class _Turn:
    """A user turn and its reply: pending (prepared, not released) until committed."""
    text: str
    origin: float                   # stream seconds of the end of the user's speech
    end_frame: int                  # recognizer frame where the transcript ends
    marks: dict                     # stage -> turn clock (stream seconds)
    endpoint: str
    branch: str
    commit_at: float = math.inf     # stream seconds the reply is released at (if still silent)
    committed: bool = False
    base: Capsule | None = None     # the conversation's capsule before this turn
    prompt: list = field(default_factory=list)     # the turn's prompt ids
    prefill_tokens: int = 0
    context_tokens: int = 0
    reply: Reply | None = None
    held: list = field(default_factory=list)       # events of the reply before its release
    reported: bool = False          # TurnDone sent


class VoiceAgent:
    """A voice conversation on one set of models (batch 1). It takes over their sessions: the
    language model, recognizer and VAD are reset to an empty stream.

    voice: a voice capsule (Synthesizer.make_voice), or the voice prompt's PCM (float32 at the
    synthesizer's rate), made into one here; without_capsules needs the PCM (it re-encodes the
    voice per reply). The recognizer needs a tokenizer (its text is the prompt's).
    messages and conversation: what the conversation holds, as chat messages (replies as the
    model wrote them) and as the model's token ids; a turn past the model's max_seq_len makes
    push() raise the prefill's ValueError."""

    def __init__(self, lm: LanguageModel, transcriber: StreamingTranscriber, vad: VoiceActivity,
                 synthesizer: Synthesizer, voice: Capsule | torch.Tensor,
                 options: VoiceOptions | None = None):
        o = options if options is not None else VoiceOptions()
        for name, obj, cls in (("lm", lm, LanguageModel), ("transcriber", transcriber, StreamingTranscriber),
                               ("vad", vad, VoiceActivity), ("synthesizer", synthesizer, Synthesizer),
                               ("options", o, VoiceOptions)):
            if not isinstance(obj, cls):
                raise TypeError(f"VoiceAgent: {name} must be a {cls.__name__}, got {type(obj).__name__}")
        if transcriber.tokenizer is None:
            raise ValueError("VoiceAgent: the transcriber has no tokenizer, so its tokens have no "
                             "text: pass StreamingTranscriber(..., tokenizer=)")
        if synthesizer.tokenizer is None:
            raise ValueError("VoiceAgent: the synthesizer has no tokenizer (load_synthesizer sets it)")
        if vad.sample_rate != transcriber.sample_rate:
            raise ValueError(f"VoiceAgent: the VAD takes {vad.sample_rate} Hz, the transcriber "
                             f"{transcriber.sample_rate} Hz")
        if not isinstance(voice, (Capsule, torch.Tensor)):
            raise TypeError(f"VoiceAgent: voice must be a voice capsule or PCM, got {type(voice).__name__}")
        if o.without_capsules and not isinstance(voice, torch.Tensor):
            raise ValueError("VoiceAgent: without_capsules re-encodes the voice per reply: pass the "
                             "voice prompt's PCM, not a capsule")
        self.lm, self.transcriber, self.vad, self.synth, self.options = lm, transcriber, vad, synthesizer, o
        self.sample_rate = vad.sample_rate
        self._voice_pcm = voice if isinstance(voice, torch.Tensor) else None
        self._voice = voice if isinstance(voice, Capsule) else (
            None if o.without_capsules else synthesizer.make_voice(voice))
        self.template = ChatTemplate(lm.model.path)
        self._tts_tokenize = tokenize_with_ends(synthesizer.tokenizer)
        self._rule = sentence_rule(synthesizer.tokenizer, o.sentence_max_tokens)
        self._frame_samples = round(transcriber.frame_seconds * self.sample_rate)
        self._pad = vad.rules.speech_pad_ms * self.sample_rate / 1000
        for part in (lm, transcriber, vad):
            part.reset()
        system = [{"role": "system", "content": o.system_prompt}] if o.system_prompt else []
        self.messages: list[dict] = system     # as the conversation holds them (replies as written)
        self.conversation: list[int] = []      # the token ids the conversation holds
        self.turns = 0                         # turns closed
        self._turn: _Turn | None = None
        self._heard: list[tuple[int, int]] = []    # the user's turn so far: (token, frame)
        self._backlog: list[torch.Tensor] = []    # audio the recognizer has not taken yet
        self._turn_frame = 0                   # recognizer frame the user's turn starts at
        self._user_text = Detokenizer(transcriber.tokenizer.decode)
        self._waiting = None                   # without capsules: (origin, end sample, marks)
        self._clock = 0.0                      # stream seconds when the agent is free
        self._start = self._t0 = 0.0
        self._reports = False                  # the caller reports what was played
        self._played = 0.0
        self._lock = threading.RLock()

    # ---- input ----------------------------------------------------------------------------
    def _pcm(self, pcm, sample_rate) -> torch.Tensor:
        """1-D float32 samples; every refusal happens here, before any state changes."""
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) \
                or sample_rate != self.sample_rate:
            raise ValueError(f"sample_rate {sample_rate!r}: the voice agent takes {self.sample_rate} Hz "
                             "mono PCM (resample first)")
        if isinstance(pcm, (bytes, bytearray, memoryview)):
            raise ValueError("pcm: expected samples, got raw bytes (PCM16 bytes: np.frombuffer(b, np.int16))")
        if isinstance(pcm, np.ndarray):
            pcm = torch.from_numpy(pcm if pcm.flags.writeable else pcm.copy())
        if not isinstance(pcm, torch.Tensor):
            raise ValueError(f"pcm: expected a 1-D torch.Tensor or numpy array of int16 or float32 "
                             f"samples, got {type(pcm).__name__}")
        if pcm.dim() != 1:
            raise ValueError(f"pcm: expected 1-D mono samples (n,), got shape {tuple(pcm.shape)}")
        if pcm.dtype == torch.int16:
            return pcm.float() / 32768.0
        if pcm.dtype != torch.float32:
            raise ValueError(f"pcm: expected int16 or float32 samples in [-1, 1], got {pcm.dtype}")
        if not bool(torch.isfinite(pcm).all()):
            raise ValueError("pcm: has non-finite samples (NaN or inf)")
        return pcm

    def push(self, pcm, sample_rate: int = 16000) -> list:
        """Take the next microphone audio (1-D int16 or float32 PCM at 16 kHz, any length) and
        return what it caused, in stream order (see events.py)."""
        with self._lock:
            x, out, i = self._pcm(pcm, sample_rate), [], 0
            while i < x.numel():
                k = min(x.numel() - i, self.vad.chunk_samples - self.vad.pending)
                self._piece(x[i: i + k], out)
                i += k
            return out

    def played(self, samples: int) -> None:
        """The speaker has played `samples` samples of the current reply, counted from its first
        frame (the ReplyAudio with frame 0); from the first report on, reports replace the
        real-time estimate."""
        if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 0:
            raise ValueError(f"played: expected a sample count >= 0, got {samples!r}")
        with self._lock:
            self._reports, self._played = True, float(samples)

    # ---- the clock ----------------------------------------------------------------------------
    def _now(self) -> float:
        """Turn clock: stream seconds, the piece's start plus the compute since."""
        return self._start + time.perf_counter() - self._t0

    def _piece(self, x: torch.Tensor, out: list) -> None:
        arrival = (self.vad.samples + x.numel()) / self.sample_rate
        self._start, self._t0 = max(self._clock, arrival), time.perf_counter()
        t = self._turn
        if not self._reports and t is not None and t.committed:     # real-time playback
            self._played += x.numel() * self.synth.sample_rate / self.sample_rate
        res = self.vad.push(x)
        self._backlog.append(x)
        if t is None or t.committed or res.events or self.vad.speaking or self._waiting is not None:
            self._listen(out)
        for ev in res.events:
            (self._on_start if isinstance(ev, SpeechStart) else self._on_end)(ev, arrival, out)
        if self._waiting is not None:
            self._lookahead_done(out)
        voiced = res.probs.numel() > 0 and float(res.probs.max()) >= self.vad.rules.threshold
        self._tick(arrival, voiced, out)
        if self._turn is None or self._turn.committed or self._waiting is not None:
            self._listen(out)
        self._clock = self._now()

    def _listen(self, out: list) -> None:
        """The recognizer takes the audio held back: while a prepared reply waits for its release
        and the VAD hears silence, only the VAD runs, so the release is not kept waiting."""
        if self._backlog:
            x = self._backlog[0] if len(self._backlog) == 1 else torch.cat(self._backlog)
            self._backlog = []
            self._partial(self.transcriber.push(x), out)

    # ---- the user's side ------------------------------------------------------------------------
    def _partial(self, tr, out: list) -> None:
        for tok, f in zip(tr.tokens, tr.frames):
            if f >= self._turn_frame:            # older frames are a committed turn's
                self._heard.append((tok, f))
                delta = self._user_text.feed(tok)
                if delta:
                    out.append(PartialTranscript(delta))

    def _on_start(self, ev, arrival: float, out: list) -> None:
        out.append(SpeechStarted(ev.sample))
        t, self._waiting = self._turn, None
        if t is not None and t.committed:
            self._barge_in(t, out)
        elif t is not None:                      # the user goes on: wait for the next end
            t.commit_at = math.inf

    def _on_end(self, ev, arrival: float, out: list) -> None:
        out.append(SpeechStopped(ev.sample))
        origin = max(0.0, ev.sample - self._pad) / self.sample_rate
        marks = {"vad": self._now()}
        if self.options.without_capsules:        # wait out the lookahead on the live stream
            self._waiting = (origin, ev.sample, marks, arrival)
            return
        fin = self.transcriber.endpoint()
        marks["transcript"] = self._now()
        toks = [tok for tok, _ in self._heard] + list(fin.tokens)
        self._final(toks, fin.end_frame, origin, marks, "fork", arrival, out)

    def _lookahead_done(self, out: list) -> None:
        origin, end, marks, arrival = self._waiting
        if self.transcriber.position * self._frame_samples < end:
            return
        self._waiting = None
        marks["transcript"] = self._now()
        self._final([tok for tok, _ in self._heard], self.transcriber.position, origin, marks,
                    "lookahead", arrival, out)

    def _final(self, toks, end_frame, origin, marks, endpoint, decided, out) -> None:
        text = self.transcriber.tokenizer.decode(toks).strip()
        t = self._turn
        if not text and t is None:               # nothing was recognized: no turn
            out.append(FinalTranscript("", "ignored"))
            return
        if t is not None and (not text or text == t.text):
            branch = "kept"
        else:
            branch = "new" if t is None else "restarted"
        out.append(FinalTranscript(text if text else t.text, branch))
        if branch == "kept":                     # the prepared reply stands: its tokens are kept
            t.origin, t.end_frame, t.endpoint, t.branch = origin, end_frame, endpoint, branch
            t.marks = {**{s: m for s, m in t.marks.items() if s not in ("vad", "transcript")}, **marks}
        else:
            if t is not None and t.base is not None:     # drop the prepared reply: back to the
                self.lm.restore(t.base)                  # conversation (no re-prefill)
            base = t.base if t is not None else None
            t = self._turn = _Turn(text, origin, end_frame, marks, endpoint, branch, base=base)
            if not self.options.without_capsules:
                self._start_reply(t)
        t.commit_at = decided + self.options.endpointing_ms / 1000

    # ---- the reply ------------------------------------------------------------------------------
    def _start_reply(self, t: _Turn) -> None:
        lm, o = self.lm, self.options
        if o.without_capsules:
            lm.reset()
        elif t.base is None:
            t.base = lm.snapshot()               # the conversation's capsule
        t.prompt = lm.tokenizer.encode(turn_prompt(self.template, self.messages, t.text, o.template_kwargs))
        ids = (self.conversation if o.without_capsules else []) + t.prompt
        lm.seed(o.seed + self.turns)
        lm.prefill(ids)
        t.prefill_tokens, t.context_tokens = len(ids), lm.position
        t.marks["prefill"] = self._now()
        t.reply = Reply(lm, self._speaker, ReplyParser(self.template.format), o, self._now)
        if not t.committed:
            self._pump(t, t.held, pending=True)

    def _speaker(self) -> IncrementalSpeaker:
        o = self.options
        voice = self.synth.make_voice(self._voice_pcm) if o.without_capsules else self._voice
        return IncrementalSpeaker(self.synth, voice, self._tts_tokenize, self._rule, o.tts_max_frames,
                                  **o.tts_knobs(self.turns))

    def _pump(self, t: _Turn, out: list, pending: bool = False, arrival: float = math.inf) -> None:
        """Make the reply: while pending, up to its first audio; then lead_ms ahead of playback,
        step by step while the agent is within listen_lag_ms of the microphone (arrival: the
        newest audio's stream seconds), so speech over the reply is heard when it comes."""
        r, lead, lag = t.reply, self.options.lead_ms, self.options.listen_lag_ms
        while not r.done:
            if pending and r.samples:
                return
            if not pending and lead is not None and \
                    r.samples - self._played >= lead * self.synth.sample_rate / 1000:
                return
            if not pending and lag is not None and r.samples and self._now() - arrival > lag / 1000:
                return
            out.extend(r.step())

    def _tick(self, arrival: float, voiced: bool, out: list) -> None:
        t = self._turn
        if t is None:
            return
        if not t.committed:
            if arrival < t.commit_at or voiced or self.vad.speaking:
                return
            t.committed, t.marks["released"] = True, self._now()
            self._played, self._turn_frame = 0.0, t.end_frame      # the next user turn starts here
            self._heard = [(tok, f) for tok, f in self._heard if f >= t.end_frame]
            self._user_text = Detokenizer(self.transcriber.tokenizer.decode)
            if self.options.without_capsules:
                self._start_reply(t)
            out.extend(t.held)
            t.held = []
        self._pump(t, out, arrival=arrival)
        if t.reply.done and not t.reported:
            t.reported = True
            out.append(TurnDone(self._timings(t), t.reply.content, interrupted=False))
        if t.reply.done and self._played >= t.reply.samples:      # played out: the turn is over
            self._close(t, len(t.reply.tokens))

    def _barge_in(self, t: _Turn, out: list) -> None:
        """Speech over the reply: keep what was played, drop the rest."""
        r = t.reply
        played = int(min(self._played, r.samples))
        if self.options.without_capsules:        # the synthesizer is cleared: nothing to roll back
            k = r.kept(r.estimate_chars(played))
        else:
            k = r.kept(r.speaker.rollback_to_played(played) if r.speaker is not None else 0)
            if self.lm.position > r.start + k:
                self.lm.rollback(r.start + k)    # recurrent state included
        out.append(BargeIn(r.heard(k), played))
        if not t.reported:
            t.reported = True
            out.append(TurnDone(self._timings(t), r.content, interrupted=True))
        self._close(t, k)

    def _close(self, t: _Turn, k: int) -> None:
        """The conversation takes the turn: its prompt and the reply's first k tokens."""
        self.conversation += t.prompt + t.reply.tokens[:k]
        self.messages += [{"role": "user", "content": t.text},
                          {"role": "assistant", "content": t.reply.raw(k)}]
        self.turns += 1
        self._turn = None

    def _timings(self, t: _Turn) -> TurnTimings:
        """Stage marks in ms after the end of speech; none earlier than the stage before it
        (a kept reply's stages, and audio made before its release)."""
        m, ms, last = {**t.marks, **t.reply.marks}, {}, 0.0
        if "first_audio" in m:
            m["first_audio"] = max(m["first_audio"], m["released"])
        for s in STAGES:
            if s in m:
                last = ms[s] = max(last, (m[s] - t.origin) * 1000)
        return TurnTimings(**ms, prefill_tokens=t.prefill_tokens, context_tokens=t.context_tokens,
                           endpoint=t.endpoint, branch=t.branch)
