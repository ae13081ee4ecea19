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
            "conversation": (None,), "prompt": (None,), "top_logprobs": (None, 0)}


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
                                                       "reasoning", "store", "metadata", "truncation", "user",
                                                       "tools", "tool_choice")}
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
        for item in items:
            _add_item(messages, item)
    else:
        raise InputError("'input' must be a string or a non-empty list of messages", "input")
    chat["messages"] = messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body.get("text"), dict):
        raise InputError("'text' must be an object ({\"format\": ...})", "text")
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    return chat


def _tools(tools) -> list:
    """Function tools ({"type": "function", "name", "description", "parameters"}) as the chat's; other
    kinds (web search, files, ...) have no chat equivalent: a 400 (llama-server skips them)."""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InputError("'tools' must be a list of {\"type\": \"function\", \"name\", ...}", "tools")
    out = []
    for t in tools:
        if t.get("type") != "function":
            raise InputError(f"tools of type {str(t.get('type'))[:40]!r} are not served here (function tools only)",
                             "tools")
        out.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                     "parameters": t.get("parameters", {})}})
    return out


def _tool_choice(choice):
    """auto, none, required, or {"type": "function", "name"} as the chat's tool_choice."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _add_item(messages: list, item) -> None:
    """One input item as chat messages, as llama-server converts them: a message; an earlier
    function call (its assistant turn's tool call, joined to the assistant turn before it); a
    function call's output (a tool message); an earlier reasoning item (its turn's reasoning)."""
    kind = item.get("type") if isinstance(item, dict) else None
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise InputError("an 'input' function_call item needs 'call_id', 'name' and 'arguments' (strings)", "input")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if last is not None:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text"
                                            and isinstance(p.get("text"), str) for p in output):
            output = "".join(p["text"] for p in output)
        if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
            raise InputError("an 'input' function_call_output item needs 'call_id' and an 'output' of text", "input")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    elif kind == "reasoning":
        content = item.get("content")
        if not (isinstance(content, list) and content and isinstance(content[0], dict)
                and isinstance(content[0].get("text"), str)):
            raise InputError("an 'input' reasoning item needs 'content': [{\"type\": \"reasoning_text\", \"text\": ...}]",
                             "input")
        if last is not None:
            last["reasoning_content"] = content[0]["text"]
        else:
            messages.append({"role": "assistant", "content": "", "reasoning_content": content[0]["text"]})
    else:
        messages.append(_message(item))


def _message(item) -> dict:
    """One input item (an input message, or an earlier output message) as a chat message."""
    if not isinstance(item, dict) or item.get("type", "message") != "message" or not isinstance(item.get("role"), str):
        kind = item.get("type") if isinstance(item, dict) else None
        raise InputError(f"an input item of type {kind!r} is not served here (messages, function calls, their "
                         f"outputs and reasoning)" if isinstance(kind, str)
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
    """One response's objects and stream events. Its output items, in llama-server's order: a
    reasoning item (the answer's reasoning), a message (its content, where there is any), a
    function_call item for each tool call."""

    def __init__(self, model: str, body: dict):
        self.model, self.body = model, body
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0
        self.items: list[dict] = []   # the stream's output items so far, the last one open

    def response(self, status: str, answer=None, last: dict | None = None) -> dict:
        """The response object: in progress (no output yet), or done with the answer's output items
        (chat_format.Message) and the request's finishing event (`last`: its usage and finish reason)."""
        tools = self.body.get("tools") or []
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": [], "error": None, "incomplete_details": None,
               "instructions": self.body.get("instructions"), "max_output_tokens": self.body.get("max_output_tokens"),
               "metadata": self.body.get("metadata") or {},
               "parallel_tool_calls": self.body.get("parallel_tool_calls", True),
               "temperature": self.body.get("temperature", 1.0), "top_p": self.body.get("top_p", 1.0),
               "tool_choice": self.body.get("tool_choice", "auto" if tools else "none"), "tools": tools,
               "text": self.body.get("text") or {"format": {"type": "text"}}}
        if answer is not None:
            out["output"] = [self.item(kind, text, name) for kind, text, name in _items(answer)]
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
        """The answer (chat_format.Message): the response object, done."""
        return self.response("completed", answer, last)

    @staticmethod
    def item(kind: str, text: str | None, name: str | None = None, status: str = "completed",
             ids: dict | None = None) -> dict:
        """An output item: kind message (text: its output text), reasoning (its text) or
        function_call (text: its arguments; name: the function's); text None: just opened."""
        ids = ids or {"id": f"{ {'message': 'msg', 'reasoning': 'rs', 'function_call': 'fc'}[kind]}_{uuid.uuid4().hex}",
                      "call_id": f"call_{uuid.uuid4().hex[:24]}"}
        if kind == "message":
            return {"id": ids["id"], "type": "message", "role": "assistant", "status": status,
                    "content": [] if text is None else [Rendering.part(text)]}
        if kind == "reasoning":
            return {"id": ids["id"], "type": "reasoning", "summary": [], "status": status,
                    "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}
        return {"id": ids["id"], "type": "function_call", "call_id": ids["call_id"], "name": name,
                "arguments": text or "", "status": status}

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
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def _open(self, kind: str, name: str | None = None, call_id: str | None = None) -> list[dict]:
        """The events that close the open item and open one of `kind` (none where one is open)."""
        if self.items and self.items[-1]["kind"] == kind and kind != "function_call":
            return []
        out = self._close() if self.items else []
        ids = {"id": f"{ {'message': 'msg', 'reasoning': 'rs', 'function_call': 'fc'}[kind]}_{uuid.uuid4().hex}",
               "call_id": call_id or ""}
        self.items.append({"kind": kind, "text": "", "name": name, "ids": ids, "index": len(self.items)})
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item=self.item(kind, None, name, "in_progress", ids)))
        if kind == "message":
            out.append(self.event("response.content_part.added", content_index=0, part=self.part(""),
                                  output_index=len(self.items) - 1, item_id=ids["id"]))
        return out

    def _close(self) -> list[dict]:
        it = self.items[-1]
        where = {"output_index": it["index"], "item_id": it["ids"]["id"]}
        done = self.item(it["kind"], it["text"], it["name"], "completed", it["ids"])
        if it["kind"] == "message":
            out = [self.event("response.output_text.done", content_index=0, text=it["text"], logprobs=[], **where),
                   self.event("response.content_part.done", content_index=0, part=self.part(it["text"]), **where)]
        elif it["kind"] == "reasoning":
            out = [self.event("response.reasoning_text.done", content_index=0, text=it["text"], **where)]
        else:
            out = [self.event("response.function_call_arguments.done", arguments=it["text"], **where)]
        it["done"] = done
        return out + [self.event("response.output_item.done", output_index=it["index"], item=done)]

    def deltas(self, delta: dict) -> list[dict]:
        """One of the chat stream's deltas (chat_format.AnswerStream's) as this API's events."""
        out = []
        if delta.get("reasoning_content"):
            out += self._open("reasoning")
            out.append(self._grow("response.reasoning_text.delta", delta["reasoning_content"]))
        if delta.get("content"):
            out += self._open("message")
            out.append(self._grow("response.output_text.delta", delta["content"], logprobs=[]))
        for call in delta.get("tool_calls", ()):
            if call.get("id"):
                out += self._open("function_call", call["function"]["name"], call["id"])
            if call["function"].get("arguments"):
                out.append(self._grow("response.function_call_arguments.delta", call["function"]["arguments"]))
        return out

    def _grow(self, kind: str, piece: str, **extra) -> dict:
        it = self.items[-1]
        it["text"] += piece
        return self.event(kind, output_index=it["index"], item_id=it["ids"]["id"], delta=piece,
                          **({"content_index": 0} if it["kind"] != "function_call" else {}), **extra)

    def closing(self, text: str, last: dict) -> list[dict]:
        out = self._close() if self.items else []
        done = self.response("completed", None, last)
        done["output"] = [it["done"] for it in self.items]
        return out + [self.event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                                 response=done)]

    def failure(self, message: str, kind: str) -> dict:
        return self.event("error", code=kind, message=message, param=None)


def _items(answer) -> list[tuple[str, str, str | None]]:
    """An answer's output items as (kind, text, function name), llama-server's order."""
    out = [("reasoning", answer.reasoning, None)] if answer.reasoning else []
    if answer.content:
        out.append(("message", answer.content, None))
    return out + [("function_call", arguments, name) for name, arguments in answer.tool_calls]
