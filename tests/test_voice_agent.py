"""flashrt.voice.VoiceAgent end to end at tiny shapes: a random-weight Qwen3.5 (the shared tiny
runner's, with the released chat template), Nemotron and Pocket TTS, the real Silero VAD, and
real speech (tests/data/speech/*.wav, made by scripts/make_speech_wavs.sh). The weights are random
(the VAD's are real), so what is recognized and said is noise: these tests check the turns, the
state and the conversation, never the words.
"""
from __future__ import annotations

import importlib.util
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("silero_vad") is None:
    pytest.skip("silero-vad is not installed (the speech extra: pip install 'flashrt[speech]')",
                allow_module_level=True)
pytest.importorskip("jinja2")       # the released chat template

from conftest import HYBRID, assert_greedy_matches, state_bytes, teacher_forced  # noqa: E402

from flashrt.models.checkpoint import make_checkpoint  # noqa: E402
from flashrt.models.loader import load_model  # noqa: E402
from flashrt.speech import StreamingTranscriber, Synthesizer, VoiceActivity, load_synthesizer  # noqa: E402
from flashrt.voice import (BargeIn, FinalTranscript, ReplyAudio, ReplyText, SpeechStarted,  # noqa: E402
                           TurnDone, VoiceAgent, VoiceOptions, turn_prompt)

DATA = Path(__file__).resolve().parent / "data" / "speech"
ARCH = "qwen3_5" if "qwen3_5" in HYBRID else HYBRID[0]      # recurrent state: rollback must carry it
TOL = 1e-4
# listen_lag_ms=None: replies are made on the audio clock alone, so runs compare event for event
FAST = dict(max_reply_tokens=16, tts_max_frames=6, lead_ms=None, listen_lag_ms=None)


def read_wav(name: str) -> torch.Tensor:
    with wave.open(str(DATA / f"{name}.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        return torch.from_numpy(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").copy())


def silence(seconds: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(int(seconds * 16000), generator=g) * 30).to(torch.int16)


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny ops contend on 2 threads


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Models shared by the module's agents (each agent resets their sessions)."""
    d = tmp_path_factory.mktemp("voice")
    asr = load_model(make_checkpoint("nemotron_asr_streaming", "tiny", d / "asr", seed=0))
    synth = load_synthesizer(make_checkpoint("pocket_tts", "tiny", d / "tts", seed=0), max_seq_len=2048,
                             codec_mark_every=4)
    g = torch.Generator().manual_seed(1)
    voice_pcm = torch.randn(4000, generator=g) * 0.3
    return dict(asr=asr, synth=synth, vad=VoiceActivity(), voice_pcm=voice_pcm,
                voice=synth.make_voice(voice_pcm))


@pytest.fixture
def make_agent(parts, runtime):
    def make(**opts):
        o = VoiceOptions(**{**FAST, **opts})
        lm = runtime(ARCH, ckpt_kw={"chat": True}, max_seq_len=4096)
        tr = StreamingTranscriber(parts["asr"], tokenizer=parts["asr"].tokenizer)
        voice = parts["voice_pcm"] if o.without_capsules else parts["voice"]
        return VoiceAgent(lm, tr, parts["vad"], parts["synth"], voice, o)
    return make


def drive(agent, pcm: torch.Tensor, piece: int = 800, report=None) -> list:
    """Push pcm in pieces; report(agent, events) after each (a speaker reporting playback)."""
    out = []
    for i in range(0, pcm.numel(), piece):
        ev = agent.push(pcm[i: i + piece])
        out += ev
        if report is not None:
            report(agent, ev)
    return out


def all_played(agent, events):
    agent.played(1 << 40)        # the speaker played everything it got


def of(events, cls):
    return [e for e in events if isinstance(e, cls)]


# ---- turns ------------------------------------------------------------------------------------
def test_two_turns_give_transcripts_reply_text_and_audio(make_agent):
    agent = make_agent()
    ev = drive(agent, torch.cat([read_wav("two_utterances"), silence(0.5)]), report=all_played)
    finals, done = of(ev, FinalTranscript), of(ev, TurnDone)
    assert [f.branch for f in finals] == ["new", "new"] and all(f.text for f in finals)
    assert len(done) == 2 and agent.turns == 2 and not any(d.interrupted for d in done)
    assert of(ev, ReplyText) and of(ev, ReplyAudio)
    frames = [a.frame for a in of(ev, ReplyAudio)]
    assert all(a.pcm.shape == (agent.synth.frame_size,) for a in of(ev, ReplyAudio))
    assert frames.count(0) == 2 and all(b in (a + 1, 0) for a, b in zip(frames, frames[1:]))
    # the conversation is the model's history; turn 2 prefilled only its own prompt, which is
    # what the chat template writes after the first reply
    conv, t1, t2 = agent.conversation, done[0].timings, done[1].timings
    assert agent.lm.tokens == conv and t1.prefill_tokens == t1.context_tokens
    assert [m["role"] for m in agent.messages] == ["user", "assistant"] * 2
    assert [agent.messages[0]["content"], agent.messages[2]["content"]] == [f.text for f in finals]
    start = t2.context_tokens - t2.prefill_tokens
    assert 0 < t2.prefill_tokens < t2.context_tokens and start >= t1.context_tokens
    tail = turn_prompt(agent.template, agent.messages[:2], finals[1].text, {"enable_thinking": False})
    assert agent.lm.tokenizer.decode(conv[start: t2.context_tokens]) == tail
    assert tail.startswith("<|im_end|>\n<|im_start|>user\n")
    for t in (t1, t2):        # the stages in order, every one reached (the values are not checked)
        marks = [t.vad, t.transcript, t.prefill, t.first_token, t.first_sentence, t.first_audio]
        assert None not in marks and marks == sorted(marks) and t.endpoint == "fork"


def test_how_the_audio_is_split_changes_nothing(make_agent):
    """Audio runs in pieces on the VAD's chunk grid: pushes of 800 or 5000 samples give the same
    events (timings aside), audio bitwise included, and the same conversation."""
    pcm = torch.cat([read_wav("two_utterances"), silence(0.5)])
    runs = []
    for piece in (800, 5000):
        agent = make_agent()
        ev = drive(agent, pcm, piece=piece, report=all_played)
        runs.append(([e for e in ev if not isinstance(e, (TurnDone, ReplyAudio))],
                     [(a.frame, a.pcm) for a in of(ev, ReplyAudio)], list(agent.conversation)))
    (ev1, audio1, conv1), (ev2, audio2, conv2) = runs
    assert ev1 == ev2 and conv1 == conv2 and len(audio1) == len(audio2) > 0
    assert all(f1 == f2 and torch.equal(p1, p2) for (f1, p1), (f2, p2) in zip(audio1, audio2))


def test_without_capsules_reprefills_reencodes_and_waits_out_the_lookahead(make_agent, monkeypatch):
    agent = make_agent(without_capsules=True)
    made = []
    make_voice = agent.synth.make_voice
    monkeypatch.setattr(agent.synth, "make_voice", lambda *a, **k: made.append(1) or make_voice(*a, **k))
    ev = drive(agent, torch.cat([read_wav("two_utterances"), silence(1.5)]), report=all_played)
    done = of(ev, TurnDone)
    assert len(done) == 2 and len(made) == 2                   # the voice encoded for each reply
    for d in done:
        t = d.timings
        assert t.endpoint == "lookahead" and t.prefill_tokens == t.context_tokens   # all re-run
    assert done[1].timings.context_tokens > done[0].timings.context_tokens
    assert agent.conversation == agent.lm.tokens


# ---- barge-in ---------------------------------------------------------------------------------
def test_barge_in_rolls_back_synthesizer_and_model_to_what_was_played(make_agent, parts, runtime,
                                                                     monkeypatch):
    """The user speaks over the reply after `played` samples: the synthesizer stands where a run
    that made only the played frames stands (bitwise), the model holds exactly the prompt and
    the reply tokens whose text was heard (its logits and greedy continuation those of a fresh
    prefill of that history), and the next turn appends to it."""
    agent = make_agent(max_reply_tokens=48, tts_max_frames=12)
    said = []                                      # (ids, chars) of each sentence spoken
    say = agent.synth.say
    monkeypatch.setattr(agent.synth, "say", lambda ids, chars=0, max_frames=None: (
        said.append((list(ids), chars)), say(ids, chars, max_frames))[1])
    agent.played(0)                                # the speaker reports: nothing played yet
    ev = drive(agent, torch.cat([read_wav("voice_weather"), silence(0.2)]))
    audio = of(ev, ReplyAudio)
    assert len(of(ev, FinalTranscript)) == 1 and len(audio) >= 4, "the reply is too short to cut"
    fs = agent.synth.frame_size
    played = (len(audio) // 2) * fs + fs // 3          # mid-frame
    agent.played(played)
    prompt_end = of(ev, TurnDone)[0].timings.context_tokens
    reply = agent.lm.tokens[prompt_end:]
    said_before = list(said)
    pcm, ev2, i = torch.cat([read_wav("voice_interrupt"), silence(0.3)]), [], 0
    while not of(ev2, BargeIn) and i < pcm.numel():       # up to the barge-in
        ev2 += agent.push(pcm[i: i + 800])
        i += 800
    barge = of(ev2, BargeIn)
    assert len(barge) == 1 and barge[0].played_samples == played
    assert ev2.index(of(ev2, SpeechStarted)[0]) < ev2.index(barge[0])
    # the conversation: the prompt and the reply tokens whose text was heard
    conv = list(agent.conversation)
    k = len(conv) - prompt_end
    assert agent.turns == 1 and agent.lm.tokens == conv and 0 <= k < len(reply)
    assert conv[prompt_end:] == reply[:k]
    assert agent.messages[1] == {"role": "assistant", "content": agent.lm.tokenizer.decode(reply[:k])}
    content = "".join(e.delta for e in of(ev, ReplyText))
    assert content.startswith(barge[0].heard_text)
    _synth_matches_played(agent, parts["voice"], said_before, played)
    # the interruption is the next turn: appended to what was heard, nothing re-run
    ev3 = drive(agent, pcm[i:])
    t2 = of(ev3, TurnDone)[0].timings
    assert t2.context_tokens - t2.prefill_tokens == len(conv)
    _model_matches_fresh(agent, runtime, conv)


@pytest.fixture
def turn_clock(parts, monkeypatch):
    """(clock, cost): the agent's turn clock reads clock[0], which only a reply step moves, by
    cost[0] seconds; the synthesizer reads every 4th byte as a full stop (random text has no
    sentence end)."""
    import flashrt.voice.agent as agent_mod
    from flashrt.voice.reply import Reply
    clock, cost = [0.0], [0.0]
    monkeypatch.setattr(agent_mod, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    step = Reply.step
    monkeypatch.setattr(Reply, "step", lambda self: (clock.__setitem__(0, clock[0] + cost[0]), step(self))[1])
    byte_tok = parts["synth"].tokenizer

    class FullStops:
        kind = "full-stops"
        encode = staticmethod(lambda text: [ord(".") if i % 4 == 3 else b for i, b in enumerate(text.encode())])
        decode = staticmethod(byte_tok.decode)
    monkeypatch.setattr(parts["synth"], "tokenizer", FullStops())
    return clock, cost


@pytest.mark.parametrize("lag_ms", [100.0, None])
def test_speech_over_a_slow_reply_is_heard_when_it_comes(make_agent, turn_clock, lag_ms):
    """A reply made slower than real time (a turn clock where each reply step costs 0.25 s and
    nothing else costs time) must not keep the agent from the microphone: past the first audio
    it waits while over listen_lag_ms behind, so the turn spoken over it ends its VAD stage
    within one step and the lag of the reference run, where steps cost nothing. None: the
    whole reply is made at its release and that turn waits for it."""
    clock, cost = turn_clock
    pcm = torch.cat([read_wav("voice_weather"), silence(1.0), read_wav("voice_interrupt"), silence(20.0)])
    vad_ms = []
    for c in (0.0, 0.25):
        cost[0] = c
        agent = make_agent(max_reply_tokens=16, tts_max_frames=4, listen_lag_ms=lag_ms)
        agent.played(0)                     # the speaker reports nothing played: the reply lasts
        ev = drive(agent, pcm)
        done = of(ev, TurnDone)
        assert len(of(ev, BargeIn)) == 1 and len(done) == 2
        vad_ms.append(done[1].timings.vad)
    if lag_ms is None:
        assert vad_ms[1] > vad_ms[0] + 1000
    else:
        assert vad_ms[1] <= vad_ms[0] + lag_ms + 250 + 1, vad_ms
    print(vad_ms)


def test_a_prepared_reply_is_released_without_waiting_for_the_recognizer(make_agent, turn_clock, monkeypatch):
    """The endpointing window's audio is silence to the VAD: the recognizer takes it after the
    release (it still takes all of it, in order). Turn clock: a reply step costs 0.25 s, the
    recognizer 0.5 s per second of audio; the first audio (made with the first sentence, the
    window long past) is out at once, not once the recognizer caught up with the window."""
    clock, cost = turn_clock
    cost[0] = 0.25
    agent = make_agent(tts_max_frames=4, endpointing_ms=400.0)
    push = agent.transcriber.push
    took = []

    def slow_push(x, *args):
        took.append(x.clone())
        clock[0] += 0.5 * x.numel() / 16000
        return push(x, *args)
    monkeypatch.setattr(agent.transcriber, "push", slow_push)
    pcm = torch.cat([read_wav("two_utterances"), silence(30.0)])
    ev = drive(agent, pcm, report=all_played)
    done = of(ev, TurnDone)
    assert len(done) == 2
    for d in done:
        split = d.timings.split()
        assert split["first_audio"] <= 1, split            # 206-208 ms with the recognizer first
    assert torch.equal(torch.cat(took), pcm.float()[: sum(x.numel() for x in took)] / 32768)


def test_without_capsules_barge_in_keeps_text_given_to_the_synthesizer(make_agent, turn_clock, monkeypatch):
    """The baseline's barge-in keeps what was played in proportion to the audio made, of the
    text the synthesizer was given: tokens decoded past the last sentence were never spoken.
    A reply made slower than real time (turn clock: 0.25 s a step), all of its audio played."""
    clock, cost = turn_clock
    cost[0] = 0.25
    agent = make_agent(without_capsules=True, max_reply_tokens=16, tts_max_frames=4, listen_lag_ms=100.0)
    said = []
    say = agent.synth.say
    monkeypatch.setattr(agent.synth, "say", lambda ids, chars=0, max_frames=None: (
        said.append(chars), say(ids, chars, max_frames))[1])
    pcm = torch.cat([read_wav("voice_weather"), silence(1.0), read_wav("voice_interrupt"), silence(3.0)])
    ev, i = [], 0
    while not of(ev, BargeIn):
        ev += agent.push(pcm[i: i + 800])
        agent.played(1 << 40)
        i += 800
    barge, content = of(ev, BargeIn)[0], of(ev, TurnDone)[0].text
    assert content.startswith(barge.heard_text) and 0 < len(barge.heard_text) <= sum(said) < len(content)


def _model_matches_fresh(agent, runtime, history):
    assert agent.lm.tokens[: len(history)] == history
    if agent.lm.position > len(history):
        agent.lm.rollback(len(history))
    fresh = runtime(ARCH, ckpt_kw={"chat": True}, max_seq_len=4096)
    want = fresh.prefill(history)
    got = agent.lm.arena["meta.logits"].clone()
    assert (got - want).abs().max() <= TOL * max(1.0, float(want.abs().max()))
    toks = agent.lm.generate(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    assert_greedy_matches(teacher_forced(fresh, want, toks), toks, what="after barge-in")


def _synth_matches_played(agent, voice, said, played):
    """A twin synthesizer says the same sentences with the same knobs, stopping at the last
    fully played frame: every buffer equal."""
    synth = agent.synth
    twin = Synthesizer(synth.net, synth.codec, max_seq_len=synth.session.max_seq_len, codec_mark_every=4)
    twin.reply(voice, **agent.options.tts_knobs(0))
    left = played // synth.frame_size
    for ids, chars in said:
        n = 0
        for _ in twin.say(ids, chars, agent.options.tts_max_frames):
            n += 1
            if n == left:
                break
        if n == left:
            break
        left -= n
    a, b = synth.snapshot(), twin.snapshot()
    assert a.position == b.position
    diff = [e.name for e in a.entries if not torch.equal(a.view(e.name), b.view(e.name))]
    assert not diff, f"synthesizer buffers differ from the played-only run: {diff}"


# ---- preemptive replies -----------------------------------------------------------------------
@pytest.mark.parametrize("same_text", [False, True])
def test_preemptive_reply_is_dropped_by_a_restore_or_kept(make_agent, monkeypatch, same_text):
    """A pause inside the user's turn (voice_pause.wav) ends speech for the VAD but not the
    endpointing window: the reply is prepared from the conversation's capsule and held. The
    user goes on; a changed transcript restores the capsule (the model bitwise where it was,
    only the new prompt prefilled), an unchanged one keeps the prepared tokens."""
    agent = make_agent(endpointing_ms=600)
    drive(agent, torch.cat([read_wav("voice_hello"), silence(1.0)]), report=all_played)
    assert agent.turns == 1
    base = state_bytes(agent.lm)
    if same_text:                 # the recognizer's text as if nothing new had been said
        tok = agent.transcriber.tokenizer
        monkeypatch.setattr(agent.transcriber, "tokenizer", type("Same", (), {
            "decode": staticmethod(lambda ids: "the same words" if ids else ""),
            "encode": tok.encode})())
    restored, prefilled = [], []
    restore, prefill = agent.lm.restore, agent.lm.prefill
    monkeypatch.setattr(agent.lm, "restore", lambda cap, *a, **k: (
        restore(cap, *a, **k), restored.append(state_bytes(agent.lm)))[0])
    monkeypatch.setattr(agent.lm, "prefill", lambda ids, *a, **k: (
        prefilled.append((list(ids), list(agent.lm.tokens))), prefill(ids, *a, **k))[1])
    ev = drive(agent, torch.cat([read_wav("voice_pause"), silence(1.0)]), report=all_played)
    finals = of(ev, FinalTranscript)
    assert [f.branch for f in finals] == ["new", "kept" if same_text else "restarted"], finals
    first_audio = next(i for i, e in enumerate(ev) if isinstance(e, (ReplyText, ReplyAudio)))
    assert first_audio > ev.index(finals[1])         # nothing of a prepared reply before release
    done = of(ev, TurnDone)
    assert len(done) == 1 and agent.turns == 2
    if same_text:
        assert restored == [] and len(prefilled) == 1 and done[0].timings.branch == "kept"
    else:
        assert len(restored) == 1 and torch.equal(restored[0], base)    # bitwise the conversation
        assert len(prefilled) == 2 and prefilled[1][1] == prefilled[0][1]   # from the same history
        assert done[0].timings.prefill_tokens == len(prefilled[1][0])       # only the new prompt
    assert agent.lm.tokens == agent.conversation


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("pcm, rate, match", [
    (np.zeros(512, np.float64), 16000, "int16 or float32"),
    (torch.zeros(2, 512), 16000, "1-D mono"),
    (torch.zeros(512), 8000, "16000 Hz"),
    (b"\x00\x01" * 256, 16000, "raw bytes"),
    ([0.0] * 512, 16000, "torch.Tensor or numpy"),
    (torch.full((512,), float("nan")), 16000, "non-finite"),
    (torch.zeros(512, dtype=torch.int16), 16000.0, "16000 Hz"),
], ids=["float64", "stereo", "8kHz", "bytes", "list", "nan", "float-rate"])
def test_bad_audio_is_refused_with_state_untouched(make_agent, pcm, rate, match):
    agent = make_agent()
    drive(agent, read_wav("voice_hello")[:8000])          # mid-utterance
    before = (state_bytes(agent.lm), agent.vad.snapshot(), agent.transcriber.snapshot(),
              agent.vad.samples, agent.transcriber.pending, list(agent.conversation))
    with pytest.raises(ValueError, match=match):
        agent.push(pcm, rate)
    after = (state_bytes(agent.lm), agent.vad.snapshot(), agent.transcriber.snapshot(),
             agent.vad.samples, agent.transcriber.pending, list(agent.conversation))
    assert torch.equal(before[0], after[0]) and before[3:] == after[3:]
    for a, b in zip(before[1:3], after[1:3]):
        assert [torch.equal(a.view(e.name), b.view(e.name)) for e in a.entries] == [True] * len(a.entries)


def test_bad_options_and_parts_are_refused(parts, runtime):
    with pytest.raises(ValueError, match="max_reply_tokens"):
        VoiceOptions(max_reply_tokens=0)
    with pytest.raises(ValueError, match="lead_ms"):
        VoiceOptions(lead_ms=-1)
    with pytest.raises(ValueError, match="listen_lag_ms"):
        VoiceOptions(listen_lag_ms=float("nan"))
    lm = runtime(ARCH, ckpt_kw={"chat": True}, max_seq_len=4096)
    tr = StreamingTranscriber(parts["asr"], tokenizer=parts["asr"].tokenizer)
    with pytest.raises(ValueError, match="voice prompt's PCM"):
        VoiceAgent(lm, tr, parts["vad"], parts["synth"], parts["voice"], VoiceOptions(without_capsules=True))
    with pytest.raises(ValueError, match="no tokenizer"):
        VoiceAgent(lm, StreamingTranscriber(parts["asr"].net), parts["vad"], parts["synth"], parts["voice"])
    with pytest.raises(TypeError, match="transcriber must be"):
        VoiceAgent(lm, parts["vad"], parts["vad"], parts["synth"], parts["voice"])
