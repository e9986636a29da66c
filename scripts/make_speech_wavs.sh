#!/usr/bin/env bash
# Makes the real-speech test audio in tests/data/speech/ (16 kHz mono 16-bit WAV, read by
# tests/test_speech_vad.py and tests/test_voice_agent.py with Python's wave module, and the
# voice_*.wav user turns by examples/voice_agent.py and bench/voice.py): espeak-ng speaks, sox
# resamples, adds quiet noise in repeatable mode (-R: same bytes each run) and joins the pieces
# with silences.
# Needs Debian's espeak-ng and sox (apt-get install -y espeak-ng sox). Output is committed; rerun
# only to change it (another espeak-ng or sox version may give other bytes).
#
#   scripts/make_speech_wavs.sh [OUT_DIR]       # default tests/data/speech
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-tests/data/speech}
mkdir -p "$OUT"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

say() {   # say NAME VOICE TEXT: one utterance at 16 kHz mono, espeak's lead-in/out trimmed
  espeak-ng -v "$2" -s 165 -w "$TMP/$1.raw.wav" "$3"
  sox -R "$TMP/$1.raw.wav" -r 16000 -c 1 -b 16 "$TMP/$1.wav" \
      silence 1 0.02 0.5% reverse silence 1 0.02 0.5% reverse
}
gap() {   # gap NAME SECONDS: silence at 16 kHz mono
  sox -R -n -r 16000 -c 1 -b 16 "$TMP/$1.wav" trim 0 "$2"
}
join() {  # join OUT PIECES...: concatenated, then quiet noise (about -60 dBFS) mixed in
  local out=$1; shift
  sox -R "${@/#/$TMP/}" "$TMP/cat.wav"
  sox -R "$TMP/cat.wav" -p synth whitenoise vol 0.001 | sox -R -m "$TMP/cat.wav" - -b 16 "$out"
}

say kitchen en-us "Turn on the kitchen lights."
say time en-gb "What time is it in Tokyo?"
say hello en-us "Hello"
say there en-us "there, how are you today?"
say hm en-us "Hm."
gap g300 0.3
gap g800 0.8
gap g70 0.07

# two utterances with a pause between them
join "$OUT/two_utterances.wav" g300.wav kitchen.wav g800.wav time.wav g300.wav
# a short pause (shorter than the default min_silence_duration_ms) inside one utterance, then
# a short sound after a pause (near min_speech_duration_ms)
join "$OUT/short_pause.wav" g300.wav hello.wav g70.wav there.wav g800.wav hm.wav g300.wav
# user turns of a voice conversation (examples/voice_agent.py): a question; a request with a
# pause inside it (longer than the VAD's silence rule, shorter than the agent's endpointing);
# a question whose answer the next file interrupts; the interruption
say hear en-us "Hello, can you hear me?"
say lights en-us "Turn on the lights"
say lights2 en-us "in the kitchen, please."
say weather en-gb "What will the weather be like tomorrow?"
say stop en-us "Wait, shorter please."
gap g250 0.25
join "$OUT/voice_hello.wav" g300.wav hear.wav g300.wav
join "$OUT/voice_pause.wav" g300.wav lights.wav g250.wav lights2.wav g300.wav
join "$OUT/voice_weather.wav" g300.wav weather.wav g300.wav
join "$OUT/voice_interrupt.wav" g70.wav stop.wav g300.wav
# more user turns for bench/voice.py's 8-turn conversation (voice_hello, voice_pause, voice_timer,
# voice_weather interrupted by voice_interrupt, voice_music, voice_remind, voice_thanks)
say timer en-us "Set a timer for ten minutes."
say music en-gb "Play some quiet music in the living room."
say remind en-us "Remind me to call my sister tonight."
say thanks en-gb "Thanks, that is all for now."
join "$OUT/voice_timer.wav" g300.wav timer.wav g300.wav
join "$OUT/voice_music.wav" g300.wav music.wav g300.wav
join "$OUT/voice_remind.wav" g300.wav remind.wav g300.wav
join "$OUT/voice_thanks.wav" g300.wav thanks.wav g300.wav
for f in "$OUT"/*.wav; do echo "$f: $(soxi -D "$f") s, $(stat -c %s "$f") bytes"; done
