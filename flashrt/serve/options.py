"""Every setting of `flashrt serve` in one object: ServeOptions, made once (from the command
line by from_args, or from a caller's keywords by from_settings) and handed to build(), the
Engine and the app as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from flashrt.lm import Options

from . import tenants

MB = 1 << 20


def _default_lm() -> Options:
    return Options(sessions=4)


@dataclass(frozen=True)
class ServeOptions:
    """lm: the model's settings (flashrt.lm.Options); its `sessions` is the server's
    max_sessions, one model session per concurrent request. The other fields are the server's
    own, one per `flashrt serve` flag. Checked when made: an error names the flag."""
    lm: Options = field(default_factory=_default_lm)
    host: str = "127.0.0.1"
    port: int = 8000
    # secrets (the key; a Redis URL may carry AUTH) stay out of repr, so out of logs
    api_key: str | None = field(default=None, repr=False)   # 'Authorization: Bearer KEY' when set
    api_keys: tuple = field(default=(), repr=False)          # more keys: one tenant each
    allowed_hosts: tuple = ()             # Host names accepted without a key, besides localhost
    read_timeout_s: float = 30.0          # a request's head, and its body, must arrive within
    max_sessions_per_key: int = 1024      # /v1/sessions a tenant may hold
    session_tokens_per_key: int = 8_000_000   # tokens a tenant's sessions and snapshots hold
    max_named_per_key: int = 64           # sessions a tenant may save by name
    capsule_named_mb: float = 1024        # disk for named saves (all tenants)
    capsule_budget_mb: float = 1024       # memory for stored capsules; 0: no reuse (a baseline)
    capsule_dir: str | None = None        # each turn's capsule on disk too, reused after a restart
    capsule_disk_mb: float = 8192         # disk for capsule_dir, LRU beyond it
    capsule_redis: str | None = field(default=None, repr=False)   # a fleet-shared capsule tier
    max_queue: int | None = None          # waiting requests before a 429; None: 4 per session
    session_idle_s: float = 3600.0        # /v1/sessions idle this long expire
    response_ttl_s: float = 86400.0       # stored /v1/responses kept this long (or until deleted)
    response_retain_mb: float = 256       # memory their capsules may hold pinned; past it, on disk or refused
    idempotency_max_records: int = 10000  # Idempotency-Key answers kept in memory, LRU beyond it
    threads: int | None = None            # torch CPU threads of the engine; None: torch's
    draft_tokens: int = 0                 # MTP drafts a speculative round; 0: off
    # speech (audio.py): a nemotron_asr_streaming checkpoint enables /v1/audio and /v1/realtime
    asr_model: str | None = None
    asr_sessions: int = 2                 # concurrent recognizer streams, forks of one model
    asr_lookahead: int | None = None      # encoder frames of right context; None: the model's first
    max_audio_s: float = 300.0            # longest file /v1/audio/transcriptions takes
    # speech out (speech.py): a pocket_tts checkpoint enables /v1/audio/speech and /v1/audio/voices
    tts_model: str | None = None
    tts_sessions: int = 2                 # concurrent syntheses, forks of one model
    max_speech_chars: int = 4096          # longest `input` /v1/audio/speech takes (OpenAI's limit)
    max_voice_s: float = 30.0             # longest reference WAV a voice is made from
    max_voices_per_key: int = 32          # voices a tenant may keep
    voice_budget_mb: float = 512          # memory for voice capsules (all tenants)
    # the voice agent (voice_session.py): /v1/voice, over the LM, --asr-model and --tts-model
    max_voice_sessions: int = 0           # concurrent voice sessions; 0: /v1/voice is off
    voice_idle_s: float = 30.0            # a voice session without a client message this long ends

    def __post_init__(self):
        if not isinstance(self.lm, Options):
            raise TypeError(f"ServeOptions.lm must be a flashrt.lm.Options, got {type(self.lm).__name__}")
        _require(self.max_queue is None or self.max_queue >= 0, f"--max-queue must be >= 0, got {self.max_queue}")
        _require(self.draft_tokens >= 0, f"--draft-tokens must be >= 0, got {self.draft_tokens}")
        _require(self.capsule_budget_mb >= 0, f"--capsule-budget-mb must be >= 0, got {self.capsule_budget_mb}")
        _require(self.capsule_disk_mb > 0, f"--capsule-disk-mb must be > 0, got {self.capsule_disk_mb}")
        _require(self.session_idle_s > 0, f"--session-idle-s must be > 0, got {self.session_idle_s}")
        _require(self.response_ttl_s > 0, f"--response-ttl-s must be > 0, got {self.response_ttl_s}")
        _require(self.response_retain_mb >= 0, f"--response-retain-mb must be >= 0, got {self.response_retain_mb}")
        _require(type(self.idempotency_max_records) is int and self.idempotency_max_records >= 1,
                 f"--idempotency-max-records must be an integer >= 1, got {self.idempotency_max_records!r}")
        _require(self.read_timeout_s > 0, f"--read-timeout-s must be > 0, got {self.read_timeout_s}")
        _require(self.max_sessions_per_key >= 1,
                 f"--max-sessions-per-key must be >= 1, got {self.max_sessions_per_key}")
        _require(self.session_tokens_per_key >= 1,
                 f"--session-tokens-per-key must be >= 1, got {self.session_tokens_per_key}")
        _require(self.max_named_per_key >= 1, f"--max-named-per-key must be >= 1, got {self.max_named_per_key}")
        _require(self.capsule_named_mb > 0, f"--capsule-named-mb must be > 0, got {self.capsule_named_mb}")
        _require(self.asr_sessions >= 1, f"--asr-sessions must be >= 1, got {self.asr_sessions}")
        _require(self.max_audio_s > 0, f"--max-audio-s must be > 0, got {self.max_audio_s}")
        _require(self.tts_sessions >= 1, f"--tts-sessions must be >= 1, got {self.tts_sessions}")
        _require(self.max_speech_chars >= 1, f"--max-speech-chars must be >= 1, got {self.max_speech_chars}")
        _require(self.max_voice_s > 0, f"--max-voice-s must be > 0, got {self.max_voice_s}")
        _require(self.max_voices_per_key >= 0,
                 f"--max-voices-per-key must be >= 0, got {self.max_voices_per_key}")
        _require(self.voice_budget_mb > 0, f"--voice-budget-mb must be > 0, got {self.voice_budget_mb}")
        _require(self.max_voice_sessions >= 0,
                 f"--max-voice-sessions must be >= 0, got {self.max_voice_sessions}")
        _require(not self.max_voice_sessions or (self.asr_model and self.tts_model),
                 "--max-voice-sessions needs --asr-model and --tts-model (the agent hears and speaks "
                 "with them)")
        _require(self.voice_idle_s > 0, f"--voice-idle-s must be > 0, got {self.voice_idle_s}")
        if self.api_key is not None:
            tenants.check_key(self.api_key, "--api-key (or FLASHRT_API_KEY)")
        for k in self.api_keys:
            tenants.check_key(k, "--api-keys")
        for h in self.allowed_hosts:
            _require(isinstance(h, str) and h and h == h.strip() and "/" not in h,
                     f"--allowed-host: bad host name {h!r}")

    @property
    def keys(self) -> dict:
        """API key -> tenant id, every key given; empty: no key is required."""
        keys = ([self.api_key] if self.api_key is not None else []) + list(self.api_keys)
        return {k: tenants.tenant_id(k) for k in keys}

    @property
    def named_bytes(self) -> int:
        return int(self.capsule_named_mb * MB)

    @property
    def max_sessions(self) -> int:
        return self.lm.sessions

    @property
    def queue_limit(self) -> int:
        return self.max_queue if self.max_queue is not None else 4 * self.max_sessions

    @property
    def voice_bytes(self) -> int:
        return int(self.voice_budget_mb * MB)

    @property
    def budget_bytes(self) -> int:
        return int(self.capsule_budget_mb * MB)

    @property
    def disk_bytes(self) -> int:
        return int(self.capsule_disk_mb * MB)

    @classmethod
    def from_settings(cls, base: ServeOptions | None = None, /, **settings) -> ServeOptions:
        """`base` (default: the defaults) with settings over it: any field of ServeOptions, any
        field of flashrt.lm.Options but sessions, and max_sessions (which sets lm.sessions)."""
        base = base if base is not None else cls()
        unknown = sorted(set(settings) - _SERVE - _LM - {"max_sessions"})
        if unknown:
            raise TypeError(f"unknown serve setting(s): {', '.join(unknown)}")
        lm = {k: v for k, v in settings.items() if k in _LM}
        if "max_sessions" in settings:
            n = settings["max_sessions"]
            # checked here: lm.Options would name its own field (sessions), not the flag
            _require(isinstance(n, int) and not isinstance(n, bool) and n >= 1,
                     f"--max-sessions must be >= 1, got {n!r}")
            lm["sessions"] = n
        own = {k: v for k, v in settings.items() if k in _SERVE}
        model = own.pop("lm", base.lm)
        return replace(base, lm=replace(model, **lm) if lm else model, **own)

    @classmethod
    def from_args(cls, ns) -> ServeOptions:
        """The options of a parsed `flashrt serve` command line (flashrt.serve.server.parser).
        The API key: --api-key, else the FLASHRT_API_KEY environment variable (out of `ps`);
        --api-keys FILE adds one tenant per line."""
        key = ns.api_key if ns.api_key is not None else tenants.key_from_env()
        return cls.from_settings(
            device=ns.device, dtype=ns.dtype, max_seq_len=ns.max_seq_len, max_sessions=ns.max_sessions,
            host=ns.host, port=ns.port, api_key=key,
            api_keys=tenants.read_keys(ns.api_keys) if ns.api_keys else (),
            allowed_hosts=tuple(ns.allowed_host or ()), read_timeout_s=ns.read_timeout_s,
            max_sessions_per_key=ns.max_sessions_per_key, session_tokens_per_key=ns.session_tokens_per_key,
            max_named_per_key=ns.max_named_per_key, capsule_named_mb=ns.capsule_named_mb,
            capsule_budget_mb=ns.capsule_budget_mb,
            capsule_dir=ns.capsule_dir, capsule_disk_mb=ns.capsule_disk_mb,
            capsule_redis=ns.capsule_redis, max_queue=ns.max_queue,
            session_idle_s=ns.session_idle_s, response_ttl_s=ns.response_ttl_s,
            response_retain_mb=ns.response_retain_mb,
            idempotency_max_records=ns.idempotency_max_records, threads=ns.threads, draft_tokens=ns.draft_tokens,
            asr_model=ns.asr_model, asr_sessions=ns.asr_sessions, asr_lookahead=ns.asr_lookahead,
            max_audio_s=ns.max_audio_s, tts_model=ns.tts_model, tts_sessions=ns.tts_sessions,
            max_speech_chars=ns.max_speech_chars, max_voice_s=ns.max_voice_s,
            max_voices_per_key=ns.max_voices_per_key, voice_budget_mb=ns.voice_budget_mb,
            max_voice_sessions=ns.max_voice_sessions, voice_idle_s=ns.voice_idle_s)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


_SERVE = frozenset(f.name for f in fields(ServeOptions))
_LM = frozenset(f.name for f in fields(Options)) - {"sessions"}
