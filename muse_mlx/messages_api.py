"""Anthropic's Messages API (`POST /v1/messages`) on the chat route, as the pinned llama-server serves it.

A request's `system` and `messages` become chat messages, as llama-server converts them
(`server_chat_convert_anthropic_to_oai`): text blocks as text parts, a `thinking` block as the
turn's `reasoning_content`, `tool_use` blocks as the turn's tool calls and `tool_result` blocks as
tool messages after it, `tools` and `tool_choice` as the chat's, `stop_sequences` as `stop`,
`max_tokens` (4,096 where absent, as llama-server's). The answer is a message of content blocks (its
reasoning as a `thinking` block, its text, each tool call a `tool_use` block) with Anthropic's stop
reasons, and the stream is that API's events. docs/server.md, "APIs", says what is served.
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
    for t in turns:
        messages += _turn(t)
    chat = {k: body[k] for k in PASSED if k in body}
    chat["messages"] = messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    chat["max_tokens"] = body["max_tokens"] if body.get("max_tokens") is not None else DEFAULT_MAX_TOKENS
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    return chat


def _tools(tools) -> list:
    """Anthropic's tools ({name, description, input_schema}) as the chat's (OpenAI's function tools)."""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InputError("'tools' must be a list of {\"name\", \"description\", \"input_schema\"}", "tools")
    return [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {})}} for t in tools]


def _tool_choice(choice) -> dict:
    """Anthropic's tool_choice as the chat's: auto, any (a call required), tool (that one, required:
    llama-server requires any call there), none; `disable_parallel_tool_use` one call at most."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    out = {}
    if kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise InputError("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} "
                         "or {\"type\": \"tool\", \"name\": ...}", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _turn(turn) -> list[dict]:
    """A turn as chat messages: the turn's own (its text, reasoning and tool calls), then a tool
    message for each of its tool results."""
    if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
        raise InputError("a turn's 'role' must be user or assistant", "messages")
    content = turn.get("content")
    if isinstance(content, str):
        return [{"role": turn["role"], "content": content}]
    if not isinstance(content, list):
        raise InputError("a turn's 'content' must be a string or a list of content blocks", "messages")
    parts, reasoning, calls, results = [], "", [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning += block["thinking"]
        elif kind == "tool_use" and turn["role"] == "assistant" and isinstance(block.get("name"), str) \
                and isinstance(block.get("input", {}), dict):
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and turn["role"] == "user" and isinstance(block.get("tool_use_id"), str):
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _result_text(block.get("content", ""))})
        else:
            raise InputError(f"content blocks of type {kind!r} are not served here (text, thinking, an assistant's "
                             f"tool_use with a name and an input object, a user's tool_result with a tool_use_id)"
                             if isinstance(kind, str) else "content blocks must be {\"type\": \"text\", \"text\": ...}",
                             "messages")
    out = []
    if parts or reasoning or calls:
        message = {"role": turn["role"], "content": parts or ""}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out + results


def _result_text(content) -> str:
    """A tool result's content as the tool message's text (text blocks joined, as llama-server joins them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise InputError("a tool_result's 'content' must be a string or text blocks (images are not served here)",
                     "messages")


def stop_reason(last: dict, calls: bool = False) -> tuple[str, str | None]:
    """The request's end in Anthropic's words: (stop_reason, stop_sequence); `calls`: the answer holds
    tool calls (a natural end is then tool_use)."""
    if last["finish_reason"] == "length":
        return "max_tokens", None
    if last.get("stop_type") == "word":
        return "stop_sequence", last["stopping_word"]
    return ("tool_use" if calls else "end_turn"), None


class Rendering:
    """One answer's message object and stream events."""

    def __init__(self, model: str, input_tokens: int):
        self.model, self.input_tokens = model, input_tokens
        self.id = f"msg_{uuid.uuid4().hex}"
        self.block: str | None = None   # the kind of the stream's open content block
        self.index = -1                 # and its index
        self.calls = False              # the stream has held a tool call

    def message(self, answer, last: dict | None) -> dict:
        """The message: empty and unfinished (the stream's first event), or with its content blocks
        (from the answer, chat_format.Message: its reasoning, text and tool calls, llama-server's
        order) and end."""
        blocks = []
        if answer is not None:
            if answer.reasoning:
                blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
            if answer.content:
                blocks.append({"type": "text", "text": answer.content})
            for name, arguments in answer.tool_calls:
                try:
                    value = json.loads(arguments)
                except ValueError:
                    value = {}
                blocks.append({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name,
                               "input": value if isinstance(value, dict) else {}})
        reason, sequence = stop_reason(last, bool(answer.tool_calls)) if last is not None else (None, None)
        usage = {"input_tokens": self.input_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0}
        if last is not None:
            u = last["usage"]
            usage.update(output_tokens=u["completion_tokens"],
                         cache_read_input_tokens=u["prompt_tokens_details"]["cached_tokens"])
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": blocks,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    def final(self, answer, last: dict) -> dict:
        """The answer: the message, done."""
        return self.message(answer, last)

    @staticmethod
    def event(kind: str, **fields) -> dict:
        return {"event": kind, "data": json.dumps({"type": kind, **fields})}

    def opening(self) -> list[dict]:
        return [self.event("message_start", message=self.message(None, None)), self.event("ping")]

    def _open(self, kind: str, block: dict) -> list[dict]:
        """The events that close the open block and open one of `kind` (none where it is open)."""
        if self.block == kind and kind != "tool_use":
            return []
        out = [self.event("content_block_stop", index=self.index)] if self.block is not None else []
        self.block, self.index = kind, self.index + 1
        return out + [self.event("content_block_start", index=self.index, content_block=block)]

    def deltas(self, delta: dict) -> list[dict]:
        """One of the chat stream's deltas (chat_format.AnswerStream's) as content block events:
        reasoning in a thinking block, text in a text block, each tool call a tool_use block whose
        input arrives as JSON text."""
        out = []
        if delta.get("reasoning_content"):
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self.event("content_block_delta", index=self.index,
                                  delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self.event("content_block_delta", index=self.index,
                                  delta={"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", ()):
            if call.get("id"):
                self.calls = True
                out += self._open("tool_use", {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                                               "name": call["function"]["name"], "input": {}})
            if call["function"].get("arguments"):
                out.append(self.event("content_block_delta", index=self.index,
                                      delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return out

    def closing(self, text: str, last: dict) -> list[dict]:
        reason, sequence = stop_reason(last, self.calls)
        out = [self.event("content_block_stop", index=self.index)] if self.block is not None else []
        return out + [self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                 usage={"output_tokens": last["usage"]["completion_tokens"]}),
                      self.event("message_stop")]

    def failure(self, message: str, kind: str) -> dict:
        return self.event("error", error={"type": kind, "message": message})
