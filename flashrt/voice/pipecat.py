"""Pipecat against `flashrt serve`: barge-in that reaches the server's cancel with what was played.

Pipecat's OpenAI services talk to the server as they are (OpenAILLMService at
/v1/chat/completions, OpenAITTSService at /v1/audio/speech, OpenAISTTService at
/v1/audio/transcriptions; base_url http://HOST:PORT/v1). On an interruption Pipecat only closes
the language model's stream: the server keeps every token it had sent, while Pipecat's context
keeps only the sentences that were played, so the next turn's prompt leaves the stored
conversation at the end of the previous prompt and the reply is prefilled again.
FlashRTLLMService closes that gap:

    llm = FlashRTLLMService(base_url=URL, api_key=KEY, settings=FlashRTLLMService.Settings(model=M))
    Pipeline([transport.input(), stt, context.user(), llm, tts, transport.output(), llm.played,
              context.assistant()])

`llm.played`, placed after transport.output() (which releases a sentence's TTSTextFrame once its
audio was written out), joins the played sentences as Pipecat's assistant context will hold them;
on an interruption it POSTs /v1/chat/completions/{id}/cancel {"delivered_chars": n}, n being how
far the streamed reply and that text agree (Pipecat trims the spaces around its sentences). The
server rolls the reply back to the tokens wholly inside those n characters (recurrent state
included), and the next turn's prompt, built from the same played text, appends to it. Each
cancel calls the "on_reply_cancelled" handlers with (llm, reply id, the kept text, the server's
answer {"id", "cancelled", "kept_tokens"}). A reply played whole but held otherwise by the
context (its spacing) stays open, and is cut the same way when the user next speaks (Pipecat
interrupts at every user turn start). Needs the `voice-clients` extra (pipecat-ai).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from loguru import logger
from pipecat.frames.frames import Frame, InterruptionFrame, LLMFullResponseEndFrame, TTSTextFrame
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.utils.string import TextPartForConcatenation, concatenate_aggregated_text


@dataclass
class _Reply:
    id: str
    text: str = ""                                   # streamed content: what delivered_chars counts
    played: list = field(default_factory=list)      # TextPartForConcatenation per played sentence

    def kept(self) -> str:
        """The longest start of the streamed text that the played text (as Pipecat joins it)
        also starts with."""
        heard = concatenate_aggregated_text(self.played)
        return self.text[: len(os.path.commonprefix([self.text, heard]))]


class FlashRTLLMService(OpenAILLMService):
    """OpenAILLMService that remembers its reply (id, streamed text) for `self.played`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._reply: _Reply | None = None
        self.played = PlayedText(self)
        self._register_event_handler("on_reply_cancelled")

    async def get_chat_completions(self, context):
        return _Recorded(await super().get_chat_completions(context), self)

    async def cancel_unplayed(self) -> dict | None:
        """Cancel the open reply at what was played; the server's answer, or None when no reply
        is open. A refused cancel is logged and the pipeline goes on (the reply is re-prefilled)."""
        reply, self._reply = self._reply, None
        if reply is None:
            return None
        kept = reply.kept()
        try:
            answer = await self._client.post(f"/chat/completions/{reply.id}/cancel", cast_to=object,
                                             body={"delivered_chars": len(kept)})
        except Exception as e:       # noqa: BLE001 - whatever the client raised, log it and go on
            logger.warning(f"{self}: cancel of {reply.id} at {len(kept)} characters failed: {e}")
            return None
        await self._call_event_handler("on_reply_cancelled", reply.id, kept, answer)
        return answer


class _Recorded:
    """A chat completion stream that records its id and content into llm._reply as it is read."""

    def __init__(self, stream, llm: FlashRTLLMService):
        self.stream, self.llm = stream, llm

    async def __aiter__(self):
        async for chunk in self.stream:
            if self.llm._reply is None or self.llm._reply.id != chunk.id:
                self.llm._reply = _Reply(chunk.id)
            if chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
                self.llm._reply.text += chunk.choices[0].delta.content
            yield chunk

    async def close(self):
        await self.stream.close()


class PlayedText(FrameProcessor):
    """After transport.output(): keeps the reply's played sentences, cancels the reply at them on
    an InterruptionFrame, and forgets it once wholly played (a reply left open is replaced by the
    next one)."""

    def __init__(self, llm: FlashRTLLMService, **kwargs):
        super().__init__(**kwargs)
        self.llm = llm

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        reply = self.llm._reply
        if isinstance(frame, TTSTextFrame) and frame.append_to_context and reply is not None:
            # the part as Pipecat's assistant aggregator takes it
            reply.played.append(TextPartForConcatenation(frame.raw_text or frame.text,
                                                         frame.includes_inter_frame_spaces))
        elif isinstance(frame, InterruptionFrame):
            await self.llm.cancel_unplayed()
        elif isinstance(frame, LLMFullResponseEndFrame) and reply is not None:
            if reply.kept() == reply.text:
                self.llm._reply = None      # all of it was played: the server keeps it whole
        await self.push_frame(frame, direction)
