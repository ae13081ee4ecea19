"""Anthropic's Messages API (`POST /v1/messages`) on the chat route, as the pinned llama-server serves it.

A request's `system` and `messages` become chat messages, as llama-server converts them
(`server_chat_convert_anthropic_to_oai`): text blocks as text parts, a `thinking` block as the
turn's `reasoning_content`, `stop_sequences` as `stop`, `max_tokens` (4,096 where absent, as
llama-server's). The answer is a message with one text block and Anthropic's stop reasons, and the
stream is that API's events. docs/server.md, "APIs", says what is served.
"""

from __future__ import annotations

import json
import uuid

DEFAULT_MAX_TOKENS = 4096   # llama-server's, where a request gives none (the API itself requires it)
PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs", "seed")


class InputError(ValueError):
    """A Messages request this server cannot take: (message, the field named)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


def to_chat(body: dict) -> dict:
    """The chat request equal to a Messages request (llama-server's conversion)."""
    if body.get("tools"):
        raise InputError("'tools' is not served here", "tools")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise InputError("'thinking' is not served here (leave it out, or send {\"type\": \"disabled\"})", "thinking")
    messages = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, list):
            if not all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
                       for b in system):
                raise InputError("'system' must be a string or a list of text blocks", "system")
            system = "".join(b["text"] for b in system)   # joined as llama-server joins them
        if not isinstance(system, str):
            raise InputError("'system' must be a string or a list of text blocks", "system")
        messages.append({"role": "system", "content": system})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise InputError("'messages' must be a non-empty list of {role, content} turns", "messages")
    messages += [_turn(t) for t in turns]
    chat = {k: body[k] for k in PASSED if k in body}
    chat["messages"] = messages
    chat["max_tokens"] = body["max_tokens"] if body.get("max_tokens") is not None else DEFAULT_MAX_TOKENS
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    return chat


def _turn(turn) -> dict:
    if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
        raise InputError("a turn's 'role' must be user or assistant", "messages")
    content = turn.get("content")
    if isinstance(content, str):
        return {"role": turn["role"], "content": content}
    if not isinstance(content, list):
        raise InputError("a turn's 'content' must be a string or a list of content blocks", "messages")
    parts, reasoning = [], ""
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning += block["thinking"]
        else:
            raise InputError(f"content blocks of type {kind!r} are not served here (text and thinking only)"
                             if isinstance(kind, str) else "content blocks must be {\"type\": \"text\", \"text\": ...}",
                             "messages")
    out = {"role": turn["role"], "content": parts or ""}
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def stop_reason(last: dict) -> tuple[str, str | None]:
    """The request's end in Anthropic's words: (stop_reason, stop_sequence)."""
    if last["finish_reason"] == "length":
        return "max_tokens", None
    if last.get("stop_type") == "word":
        return "stop_sequence", last["stopping_word"]
    return "end_turn", None


class Rendering:
    """One answer's message object and stream events."""

    def __init__(self, model: str, input_tokens: int):
        self.model, self.input_tokens = model, input_tokens
        self.id = f"msg_{uuid.uuid4().hex}"

    def message(self, text: str | None, last: dict | None) -> dict:
        """The message: empty and unfinished (the stream's first event), or with its text and end."""
        reason, sequence = stop_reason(last) if last is not None else (None, None)
        usage = {"input_tokens": self.input_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0}
        if last is not None:
            u = last["usage"]
            usage.update(output_tokens=u["completion_tokens"],
                         cache_read_input_tokens=u["prompt_tokens_details"]["cached_tokens"])
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [] if text is None else [{"type": "text", "text": text}],
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    def final(self, text: str, last: dict) -> dict:
        """The answer: the message, done."""
        return self.message(text, last)

    @staticmethod
    def event(kind: str, **fields) -> dict:
        return {"event": kind, "data": json.dumps({"type": kind, **fields})}

    def opening(self) -> list[dict]:
        return [self.event("message_start", message=self.message(None, None)),
                self.event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
                self.event("ping")]

    def delta(self, text: str) -> dict:
        return self.event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})

    def closing(self, text: str, last: dict) -> list[dict]:
        reason, sequence = stop_reason(last)
        return [self.event("content_block_stop", index=0),
                self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                           usage={"output_tokens": last["usage"]["completion_tokens"]}),
                self.event("message_stop")]

    def failure(self, message: str, kind: str) -> dict:
        return self.event("error", error={"type": kind, "message": message})
