"""Chat text: templates, tool-call and reasoning formats, and the incremental parsers that split a
model's output into reasoning, content and tool calls.

Rule: pure text. chat/ imports nothing of flashrt but errors; it knows no tensor, session or
HTTP. serve/ renders prompts and parses replies through it; so can any layer that speaks to a
chat model (a voice agent, an agent integration).
"""
from __future__ import annotations

from .template import ChatTemplate, prepare_messages, template_kwargs  # noqa: F401
from .formats import FORMATS, LFM2, PLAIN, QWEN3, QWEN3_5, ChatFormat, detect_format  # noqa: F401
from .parser import (Content, Reasoning, Reply, ReplyParser, ToolCall, ToolCallArguments,  # noqa: F401
                     ToolCallEnd, ToolCallStart, parse_reply)
