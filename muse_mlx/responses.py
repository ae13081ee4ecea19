"""OpenAI's Responses API (`POST /v1/responses`) on the chat route.

A request's `input` and `instructions` become chat messages, as llama-server converts them
(`server_chat_convert_responses_to_chat`); `max_output_tokens` becomes `max_tokens`, and OpenAI's
`text.format` becomes `response_format`. The answer is a response object with one output message,
and the stream is the Responses API's events, each carrying its `sequence_number`.
docs/server.md, "The Responses API", says what is served.
"""

from __future__ import annotations

import time
import uuid


class InputError(ValueError):
    """A Responses request this server cannot take: (message, the field named)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


# Responses fields that ask for what is not served here, at the values that ask for nothing.
UNSERVED = {"previous_response_id": (None, ""), "include": (None, []), "background": (None, False),
            "conversation": (None,), "prompt": (None,), "top_logprobs": (None, 0),
            "tools": (None, []), "tool_choice": (None, "auto", "none")}


def to_chat(body: dict) -> dict:
    """The chat request equal to a Responses request (llama-server's conversion, plus `text.format`)."""
    for name, neutral in UNSERVED.items():
        if name in body and not any(body[name] is n or (n is not None and type(body[name]) is type(n)
                                                        and body[name] == n) for n in neutral):
            raise InputError(f"'{name}' is not served here (responses are not stored)" if name in (
                "previous_response_id", "conversation") else f"'{name}' is not served here", name)
    if "input" not in body:
        raise InputError("'input' is required", "input")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "max_output_tokens", "text",
                                                       "reasoning", "store", "metadata", "truncation", "user")}
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InputError("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        messages += [_message(item) for item in items]
    else:
        raise InputError("'input' must be a string or a non-empty list of messages", "input")
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body.get("text"), dict):
        raise InputError("'text' must be an object ({\"format\": ...})", "text")
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    return chat


def _message(item) -> dict:
    """One input item (an input message, or an earlier output message) as a chat message."""
    if not isinstance(item, dict) or item.get("type", "message") != "message" or not isinstance(item.get("role"), str):
        kind = item.get("type") if isinstance(item, dict) else None
        raise InputError(f"an input item of type {kind!r} is not served here (messages only)" if isinstance(kind, str)
                         else "'input' items must be messages ({role, content})", "input")
    role, content = item["role"], item.get("content")
    if role not in ("user", "system", "developer", "assistant"):
        raise InputError(f"an input message's role must be user, system, developer or assistant, not {role[:40]!r}",
                         "input")
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
                raise InputError(f"a message's {kind!r} content part is not served here (text only)"
                                 if isinstance(kind, str) else "a message's content parts must be "
                                 "{\"type\": \"input_text\", \"text\": ...}", "input")
            parts.append({"type": "text", "text": part["text"]})
        content = parts
    elif not isinstance(content, str):
        raise InputError("an input message's 'content' must be a string or a list of text parts", "input")
    return {"role": "system" if role == "developer" else role, "content": content}


def _format(fmt) -> dict:
    """`text.format` as the chat route's response_format."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), (dict, bool)):
            raise InputError("'text.format' of type json_schema needs 'schema'", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", ""), "schema": fmt["schema"]}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise InputError("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                     "{\"type\": \"json_schema\", \"schema\": ...}", "text")


class Rendering:
    """One response's objects and stream events."""

    def __init__(self, model: str, body: dict):
        self.model, self.body = model, body
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0

    def response(self, status: str, text: str | None = None, last: dict | None = None) -> dict:
        """The response object: in progress (no output yet), or done with its text and the
        request's finishing event (`last`: its usage and finish reason)."""
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": [], "error": None, "incomplete_details": None,
               "instructions": self.body.get("instructions"), "max_output_tokens": self.body.get("max_output_tokens"),
               "metadata": self.body.get("metadata") or {}, "parallel_tool_calls": False,
               "temperature": self.body.get("temperature", 1.0), "top_p": self.body.get("top_p", 1.0),
               "tool_choice": "none", "tools": [], "text": self.body.get("text") or {"format": {"type": "text"}}}
        if text is not None:
            out["output"] = [self.message(text, "completed")]
        if last is not None:
            u = last["usage"]
            out["usage"] = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                            "total_tokens": u["total_tokens"],
                            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                            "output_tokens_details": {"reasoning_tokens": 0}}
            if last["finish_reason"] == "length":   # OpenAI's word for a response cut by its token limit
                out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            out["completed_at"] = int(time.time())
            out["timings"] = last.get("timings")
        return out

    def final(self, answer, last: dict) -> dict:
        """The answer (chat_format.Message: its content is the output's text): the response object, done."""
        return self.response("completed", answer.content, last)

    def deltas(self, delta: dict) -> list[dict]:
        """One of the chat stream's deltas as this API's events: its content (reasoning and tool
        calls are not served here)."""
        return [self.delta(delta["content"])] if delta.get("content") else []

    def message(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self.part(text)]
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, kind: str, **fields) -> dict:
        """One SSE event: its type as the event name and in its data, with the next sequence number."""
        import json

        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(data)}

    def opening(self) -> list[dict]:
        where = {"output_index": 0, "item_id": self.message_id}
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress")),
                self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress")),
                self.event("response.content_part.added", content_index=0, part=self.part(""), **where)]

    def delta(self, text: str) -> dict:
        return self.event("response.output_text.delta", output_index=0, content_index=0, item_id=self.message_id,
                          delta=text, logprobs=[])

    def closing(self, text: str, last: dict) -> list[dict]:
        where = {"output_index": 0, "content_index": 0, "item_id": self.message_id}
        done = self.response("completed", text, last)
        return [self.event("response.output_text.done", text=text, logprobs=[], **where),
                self.event("response.content_part.done", part=self.part(text), **where),
                self.event("response.output_item.done", output_index=0, item=done["output"][0]),
                self.event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                           response=done)]

    def failure(self, message: str, kind: str) -> dict:
        return self.event("error", code=kind, message=message, param=None)
