"""muse-glimmer's chat format as the pinned llama-server serves it: a chat answer split into its
reasoning, its content and its tool calls, and the tool calls' grammar.

The model answers in messages, each `<|start|>assistant to=<recipient><|message|>{text}<END>`, END
being `<|eom|>` (more follow) or `<|eot|>` (the turn ends): recipient `self` is reasoning, `user`
(or none) the answer, any other a tool call in ATEM markup (`<atem:function_calls>`,
`<atem:invoke name="...">`, `<atem:parameter name="...">value</atem:parameter>`). The generation
prompt is `<|start|>assistant`. llama.cpp reads an answer with a PEG parser built per request
(common/parsers/muse-glimmer.cpp); `parse` here reads it the same way, checked against that parser
built from the pinned sdist (tests/chat_oracle.py). A template is muse-glimmer's when its text holds
`<atem:function_calls>` and `<|eom|>`, as llama.cpp decides. docs/server.md, "Tool calls and
reasoning", gives the design.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

START = "<|start|>assistant"
MESSAGE, EOM, EOT = "<|message|>", "<|eom|>", "<|eot|>"
ARG_CLOSE = "</atem:parameter>"
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
# the format's markup, which llama-server renders in the text it parses even where the vocabulary
# makes a token of it a control token (its preserved tokens)
PRESERVED = ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "<atem:function_calls>", "<atem:invoke",
             "<atem:parameter", "</atem:parameter>", "</atem:invoke>", "</atem:function_calls>")
TOOL_CHOICES = ("auto", "none", "required")
# llama.cpp's lazy grammar trigger: the answer's first message goes to a recipient that is not
# `self` or `user` (its text from " to=" on is then held to a tool call)
TRIGGER = r"(?:^|<\|start\|>assistant)( to=(?!self<\|message\|>)(?!user<\|message\|>)[^<]*?<\|message\|>)"


class FormatError(ValueError):
    """A request's tools or chat options that cannot be served (the message names the field)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


def is_muse_glimmer(template: str) -> bool:
    """Whether a chat template is muse-glimmer's (llama.cpp's test: chat.cpp's specialized templates)."""
    return "<atem:function_calls>" in template and EOM in template


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    strings: frozenset   # the parameters whose schema admits a string: their values are raw text

    def as_template_input(self) -> dict:
        """As llama.cpp hands a tool to the template (common_chat_tools_to_json_oaicompat)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class Message:
    """An answer read: its reasoning, content and tool calls ([name, arguments JSON text])."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)


STRING_FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")


def _may_be_string(schema, root: dict, seen: frozenset = frozenset()) -> bool:
    """Whether a parameter's value is taken as raw text, as llama.cpp decides it (json-schema.cpp's
    may_be_string over the schema its builder makes): a string type, a string const or enum member,
    an anyOf / oneOf member or a type list naming string, an allOf whose constraining members all
    may be strings, a `$ref` into the tool's parameters that may be (a cycle: no); a schema without a
    type is a string's only by a string's keywords (pattern, lengths, a string format)."""
    if not isinstance(schema, dict):
        raise FormatError("a tool parameter's schema must be an object", "tools")
    if "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise FormatError(f"a tool's $ref must point into its parameters ('#/...'), got {str(ref)[:60]!r}", "tools")
        if ref in seen:
            return False
        target = root
        for sel in ref[2:].split("/"):
            if isinstance(target, dict) and sel in target:
                target = target[sel]
            elif isinstance(target, list) and sel.isdigit() and int(sel) < len(target):
                target = target[int(sel)]
            else:
                raise FormatError(f"a tool's $ref {ref[:60]!r} does not resolve", "tools")
        return _may_be_string(target, root, seen | {ref})
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return isinstance(schema[key], list) and any(_may_be_string(c, root, seen) for c in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return any(_may_be_string({**schema, "type": t}, root, seen) for t in kind)
    if "const" in schema:
        return isinstance(schema["const"], str)
    if "enum" in schema:
        return isinstance(schema["enum"], list) and any(isinstance(v, str) for v in schema["enum"])
    has_properties = "properties" in schema or schema.get("additionalProperties", True) is not True
    if kind is None:
        if has_properties:
            return False
        if "allOf" in schema:
            return _all_may_be_strings(schema["allOf"], root, seen)
        if "items" in schema or "prefixItems" in schema:
            return False
        return any(k in schema for k in ("pattern", "minLength", "maxLength")) or schema.get("format") in STRING_FORMATS
    if kind == "object" and not has_properties and "allOf" in schema:
        return _all_may_be_strings(schema["allOf"], root, seen)
    if kind == "string":
        return _all_may_be_strings(schema["allOf"], root, seen) if "allOf" in schema else True
    return False


# the keywords that make a schema something other than llama.cpp's "any" node
_SHAPING = ("$ref", "oneOf", "anyOf", "type", "const", "enum", "properties", "allOf", "items", "prefixItems",
            "pattern", "minLength", "maxLength")


def _all_may_be_strings(children, root: dict, seen: frozenset) -> bool:
    """allOf: every member that constrains anything may be a string, and one does."""
    if not isinstance(children, list):
        return False
    shaping = [c for c in children if not isinstance(c, dict) or any(k in c for k in _SHAPING)
               or c.get("additionalProperties", True) is not True or c.get("format") in STRING_FORMATS]
    return bool(shaping) and all(_may_be_string(c, root, seen) for c in shaping)


MAX_SCHEMA_DEPTH = 64   # a tool's parameters nest at most this deep (llguidance's %json refuses far deeper)


def nesting(node, limit: int) -> int:
    """How deep a JSON value nests, counted up to limit + 1 (iteratively: a hostile value cannot
    exhaust the stack here)."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, depth)
            if depth <= limit:
                stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def read_tools(value) -> tuple[Tool, ...]:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}} (llama.cpp's common_chat_tools_parse_oaicompat)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise FormatError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        what = f"'tools[{i}]'"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise FormatError(f"{what} must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", "tools")
        fn = tool["function"]
        name, description, parameters = fn.get("name"), fn.get("description", ""), fn.get("parameters", {})
        if not isinstance(name, str) or not name or any(c in name for c in '"<>\n'):
            raise FormatError(f"{what}'s function needs a 'name': a non-empty string without quotes, angle "
                              f"brackets or newlines", "tools")
        if name in names:
            raise FormatError(f"{what}: two tools are named {name!r}", "tools")
        if not isinstance(description, str):
            raise FormatError(f"{what}'s 'description' must be a string", "tools")
        if nesting(parameters, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise FormatError(f"{what}'s 'parameters' nest more than {MAX_SCHEMA_DEPTH} levels deep", "tools")
        properties = parameters.get("properties", {}) if isinstance(parameters, dict) else None
        if not isinstance(properties, dict) or any(not isinstance(k, str) or not k or any(c in k for c in '"<>\n')
                                                   for k in properties):
            raise FormatError(f"{what}'s 'parameters' must be a JSON schema object whose 'properties' are named "
                              f"without quotes, angle brackets or newlines", "tools")
        names.add(name)
        try:
            strings = frozenset(k for k, schema in properties.items() if _may_be_string(schema, parameters))
        except FormatError as exc:
            raise FormatError(f"{what}: {exc.message}", "tools") from None
        except RecursionError:
            raise FormatError(f"{what}: its parameters' schema nests too deeply", "tools") from None
        tools.append(Tool(name, description, parameters, strings))
    return tuple(tools)


@dataclass(frozen=True)
class ChatFormat:
    """One request's reading of the answer: `reasoning` the reasoning split out (any
    reasoning_format but none), `tools` the calls it may hold (none with tool_choice none),
    `required` a tool call forced from the first token (tool_choice required), `parallel` several
    calls in one answer."""
    tools: tuple = ()
    reasoning: bool = True
    required: bool = False
    parallel: bool = False
    prefill: str = ""   # what follows START in the prompt: an assistant message continued (continuation)

    @property
    def structured(self) -> bool:
        """Whether the answer is parsed at all (reasoning_format none without tools: the text is the content)."""
        return self.reasoning or bool(self.tools)

    def parse(self, text: str) -> Message | None:
        """The generated text (after the generation prompt, special tokens shown) read into its parts,
        as the pinned llama.cpp's parser reads it; None where that parser fails (llama.cpp then
        answers with an error; the caller takes the text as the content)."""
        if not self.structured:
            return Message(content=self.prefill + text)
        return _Parser(START + self.prefill + text, self).answer()


CONTINUATIONS = {True: "auto", "content": "content", "reasoning_content": "reasoning"}


def continuation(body: dict, prefill_assistant: bool) -> str | None:
    """How a chat request continues its last message, as the pinned llama-server decides
    (server-common.cpp): llama-server's `continue_final_message` (true, "content" or
    "reasoning_content"), else, with `prefill_assistant` (its default), a last message from the
    assistant; `auto` is then "reasoning" for a message with reasoning and no content, else "content".
    None: no continuation. FormatError for what llama-server refuses."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return None   # (the prompt's rendering names what is wrong)
    asked = body.get("continue_final_message")
    if asked is None or asked is False:
        mode = None
    elif asked is True or asked in ("content", "reasoning_content"):
        mode = CONTINUATIONS[asked]
    else:
        raise FormatError("'continue_final_message' must be true, false, \"content\" or \"reasoning_content\"",
                          "continue_final_message")
    generation_prompt = body.get("add_generation_prompt") is not False
    if mode is None and prefill_assistant and messages[-1].get("role") == "assistant":
        if len(messages) >= 2 and messages[-2].get("role") == "assistant":
            raise FormatError("cannot have 2 or more assistant messages at the end of the list", "messages")
        mode, generation_prompt = "auto", False
    if mode is None:
        return None
    if generation_prompt:
        raise FormatError("cannot set both add_generation_prompt and continue_final_message to true",
                          "continue_final_message")
    last = messages[-1]
    if last.get("role") == "assistant" and last.get("tool_calls"):
        raise FormatError("cannot continue an assistant message that contains tool calls", "messages")
    if mode == "auto":
        reasoning = last.get("reasoning_content")
        mode = "reasoning" if isinstance(reasoning, str) and reasoning and not last.get("content") else "content"
    return mode


def continued(mode: str, reasoning: str, content: str) -> str:
    """What follows START in the prompt of an answer continued (common/parsers/muse-glimmer.cpp): its
    reasoning message, and with mode "content" the answer's message so far."""
    out = " to=self" + MESSAGE + reasoning
    return out + EOM + START + " to=user" + MESSAGE + content if mode == "content" else out


def read_format(body: dict, default_reasoning: str = "auto") -> tuple[ChatFormat, tuple]:
    """A chat request's `tools`, `tool_choice` ("auto", "none", "required", or OpenAI's
    {"type": "function", "function": {"name"}}: that tool alone, required), `parallel_tool_calls` and
    llama-server's `reasoning_format` -> (its ChatFormat, every tool offered: the template shows
    them all, even with tool_choice none, as llama.cpp's does). FormatError names a wrong field."""
    offered = read_tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    if choice is None:
        choice = "auto"
    tools = offered
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        tools = tuple(t for t in offered if t.name == name)
        if not tools:
            raise FormatError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}} naming one of the 'tools'", "tool_choice")
        choice = "required"
    elif choice not in TOOL_CHOICES:
        raise FormatError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    if choice == "none":
        tools = ()
    if choice == "required" and not tools:
        raise FormatError("'tool_choice' \"required\" needs 'tools'", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)   # llama-server's default: the template renders several calls
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise FormatError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    reasoning = body.get("reasoning_format", default_reasoning)
    if reasoning is None:
        reasoning = default_reasoning
    if reasoning not in REASONING_FORMATS:
        raise FormatError(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format")
    return ChatFormat(tools, reasoning != "none", choice == "required", parallel), offered


def template_tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's OpenAI `tool_calls` as the template takes them: each call's
    `arguments` (a JSON object's text) read into the object, as llama.cpp hands them to a template
    that needs a mapping (muse-glimmer's raises otherwise)."""
    where = f"'messages[{i}].tool_calls'"
    if not isinstance(calls, list):
        raise FormatError(f"{where} must be a list of {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          f"\"arguments\"}}}}", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FormatError(f"{where}: each call needs a 'function' with a 'name'", "messages")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                arguments = None
        if not isinstance(arguments, dict):
            raise FormatError(f"{where}: a call's 'arguments' must be a JSON object (or its text)", "messages")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


# ---- the tool calls' grammar (llguidance's lark syntax; docs/server.md says when it applies) ----

SPACE = "SP?"   # llama.cpp's `space` rule: nothing, a space, or one or two newlines and up to 20 spaces or tabs
SPACE_RULE = r"SP: / |\n{1,2}[ \t]{0,20}/"


class GrammarText:
    """A lark grammar's pieces for one vocabulary: `special(text)` gives the id of a token that
    llguidance's table marks special (grammar.Grammars.special_id), which a grammar's text cannot
    match and must name as <[id]>."""

    def __init__(self, special):
        self.special = special
        self.rules: list[str] = []

    def lit(self, text: str) -> str:
        """A literal: quoted text, with the vocabulary's special tokens in it named by id."""
        out, i, piece = [], 0, ""
        while i < len(text):
            j = text.find("<", i)
            if j < 0:
                piece += text[i:]
                break
            piece += text[i:j]
            k = text.find(">", j)
            token = self.special(text[j:k + 1]) if k > j else None
            if token is None:
                piece += "<"
                i = j + 1
                continue
            if piece:
                out.append(json.dumps(piece, ensure_ascii=False))
            out.append(f"<[{token}]>")
            piece, i = "", k + 1
        if piece:
            out.append(json.dumps(piece, ensure_ascii=False))
        return " ".join(out) if out else '""'

    def until(self, name: str, delimiter: str) -> str:
        """Any text, then `delimiter` (a rule named `name`): the text stops at the delimiter's first
        appearance where it is text; a special token cannot appear in text at all."""
        token = self.special(delimiter)
        if token is not None:
            self.rules.append(f"{name}: /(?s:.*)/ <[{token}]>")
        else:
            self.rules.append(f"{name}[lazy]: /(?s:.*){_regex_escape(delimiter)}/")
        return name

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.rules, SPACE_RULE]) + "\n"


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/" else c for c in text)


def tools_grammar(fmt: ChatFormat, special) -> str:
    """The lark grammar a tool call is held to: with tool_choice required the whole answer (its
    reasoning messages, then a call), else (lazy) the text from the trigger's " to=" on."""
    g = GrammarText(special)
    calls = []
    for n, tool in enumerate(fmt.tools):
        args = []
        for m, (name, schema) in enumerate(tool.parameters.get("properties", {}).items()):
            head = g.lit(f'<atem:parameter name="{name}">')
            if name in tool.strings:
                args.append(f"{head} {g.until(f'arg_{n}_{m}', ARG_CLOSE)}")
            else:
                doc = _json_spaced(_parameter_schema(tool.parameters, name))
                args.append(f"{head} %json {json.dumps(doc, ensure_ascii=False)} {g.lit(ARG_CLOSE)}")
        g.rules.append(f"args_{n}: " + (" | ".join(f"({a}) {SPACE}" for a in args) if args else '""'))
        parts = [g.lit(" to="), g.until(f"to_{n}", MESSAGE), g.lit("<atem:function_calls>"), SPACE,
                 g.lit(f'<atem:invoke name="{tool.name}">'), SPACE, f"args_{n}*",
                 g.lit("</atem:invoke>"), SPACE, g.lit("</atem:function_calls>")]
        g.rules.append(f"call_{n}: " + " ".join(parts))
        calls.append(f"call_{n}")
    g.rules.append("call: " + " | ".join(calls))
    g.rules.append("calls: call" + (f" ({g.lit(EOM + START)} call)*" if fmt.parallel else ""))
    if not fmt.required:
        return g.text("calls")
    g.rules.append(f"analysis: {g.lit(' to=self' + MESSAGE)} {g.until('reasoning', EOM)} {g.lit(START)}")
    return g.text("analysis* calls")


def answer_grammar(schema_text: str, special) -> str:
    """response_format's JSON as muse-glimmer's answer holds it (llama.cpp's response-format rule):
    reasoning messages, then the answer's message, its text the JSON."""
    g = GrammarText(special)
    g.rules.append(f"analysis: {g.lit(' to=self' + MESSAGE)} {g.until('reasoning', EOM)} {g.lit(START)}")
    schema = json.loads(schema_text)
    schema = _json_spaced(schema if isinstance(schema, dict) else {})
    return g.text(f"analysis* ({g.lit(' to=user')})? {g.lit(MESSAGE)} %json {json.dumps(schema, ensure_ascii=False)}")


ROOT_KEY = "muse_tool_parameters"   # where a parameter's document keeps the tool's parameters, for its $refs


def _parameter_schema(parameters: dict, name: str) -> dict:
    """A parameter's schema as a document of its own whose `$ref`s still reach into the tool's
    parameters (where the tool's `$defs` live): the parameters sit under $defs.ROOT_KEY, each
    `#/...` pointer rewritten to `#/$defs/ROOT_KEY/...`."""
    def moved(node):
        if isinstance(node, dict):
            return {k: (f"#/$defs/{ROOT_KEY}/" + v[2:] if k == "$ref" and isinstance(v, str) and v.startswith("#/")
                        else moved(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [moved(v) for v in node]
        return node
    schema = moved(parameters["properties"][name])
    defs = schema.get("$defs") if isinstance(schema.get("$defs"), dict) else {}
    return {**schema, "$defs": {**defs, ROOT_KEY: moved(parameters)}}


def _json_spaced(schema: dict) -> dict:
    """A schema with llama.cpp's whitespace between JSON's parts (grammar.JSON_WHITESPACE)."""
    from .grammar import JSON_WHITESPACE

    guidance = dict(schema.get("x-guidance") or {})
    guidance.setdefault("whitespace_pattern", JSON_WHITESPACE)
    return {**schema, "x-guidance": guidance}


# ---- the answer as a stream of OpenAI deltas ----

class AnswerStream:
    """The chat route's stream for one choice: each piece of text in, the deltas out (reasoning,
    content, tool calls: a call's name and id once its name is whole, then its arguments as they
    grow), as llama-server's diffs of the partial parses. Where the text stops following the
    format, the rest goes out as content (llama.cpp would end the request with an error)."""

    def __init__(self, fmt: ChatFormat, new_id):
        self.fmt, self.new_id = fmt, new_id
        self.text = ""
        self.sent = Message()
        self.ids: list[str] = []
        self.raw = False        # the text does not follow the format: it is the content as it comes
        self.raw_sent = 0

    def push(self, piece: str) -> list[dict]:
        self.text += piece
        if self.raw:
            return self._raw()
        msg = self.fmt.parse(self.text)
        if msg is None:
            self.raw = True
            return self._raw()
        out = []
        if len(msg.reasoning) > len(self.sent.reasoning):
            out.append({"reasoning_content": msg.reasoning[len(self.sent.reasoning):]})
        if len(msg.content) > len(self.sent.content):
            out.append({"content": msg.content[len(self.sent.content):]})
        for i, (name, arguments) in enumerate(msg.tool_calls):
            if i >= len(self.sent.tool_calls):
                self.ids.append(self.new_id())
                out.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function",
                                            "function": {"name": name, "arguments": arguments}}]})
            elif len(arguments) > len(self.sent.tool_calls[i][1]):
                out.append({"tool_calls": [{"index": i, "function": {
                    "arguments": arguments[len(self.sent.tool_calls[i][1]):]}}]})
        self.sent = Message(msg.content, msg.reasoning, [list(c) for c in msg.tool_calls])
        return out

    def _raw(self) -> list[dict]:
        piece, self.raw_sent = self.text[self.raw_sent:], len(self.text)
        return [{"content": piece}] if piece else []

    def message(self) -> Message:
        """The whole answer read (the text as the content where it does not follow the format)."""
        if self.raw:
            return Message(content=self.text)
        return self.fmt.parse(self.text) or Message(content=self.text)


class AnswerDisplay:
    """A chat answer as the pinned llama-cli shows it on a terminal (tools/cli/cli-ui.h's
    assistant_turn): the reasoning between "[Start thinking]" and "[End thinking]" lines, then the
    content. Text in, display text out; `close` ends it with a newline (and "[End thinking]" where
    the answer ended in its reasoning, as it does at <|eom|>: llama-cli leaves that open)."""

    def __init__(self, fmt: ChatFormat):
        self.stream = AnswerStream(fmt, lambda: "")
        self.mode = "content"
        self.thinking = False
        self.trailing_newline = True

    def push(self, piece: str) -> str:
        out = []
        for delta in self.stream.push(piece):
            for key, mode in (("reasoning_content", "reasoning"), ("content", "content")):
                if key in delta:
                    out.append(self._show(mode, delta[key]))
        return "".join(out)

    def _show(self, mode: str, text: str) -> str:
        out = ""
        if mode != self.mode:
            out += "" if self.trailing_newline else "\n"
            if mode == "reasoning":
                out += "\n[Start thinking]\n\n"
                self.thinking = True
            elif self.thinking:
                out += "[End thinking]\n\n"
                self.thinking = False
            self.mode = mode
        if text:
            self.trailing_newline = text.endswith("\n")
        return out + text

    def close(self) -> str:
        out = "" if self.trailing_newline else "\n"
        return out + ("[End thinking]\n" if self.thinking else "")


def message_of(fmt: ChatFormat | None, text: str) -> Message:
    """A whole answer read; the text as the content where there is no format or it is not followed."""
    if fmt is None:
        return Message(content=text)
    return fmt.parse(text) or Message(content=text)


class _Parser:
    """llama.cpp's PEG for this format over one text, in its lenient mode, where text that ends inside
    a literal matches it (a cut answer reads as far as it goes) and text after a complete answer is
    ignored. Each method takes a position and gives the position after, or None. What a cut answer
    holds follows llama.cpp's mapper: a name or closing tag counts once it is whole, a value with
    what it has so far (an argument's string left open, its object unclosed)."""

    def __init__(self, text: str, fmt: ChatFormat):
        self.s, self.fmt, self.end = text, fmt, len(text)
        self.tools = {t.name: t for t in fmt.tools}

    def lit(self, pos: int, literal: str) -> int | None:
        if self.s.startswith(literal, pos):
            return pos + len(literal)
        rest = self.s[pos:]
        return self.end if len(rest) < len(literal) and literal.startswith(rest) else None

    def whole(self, pos: int, literal: str) -> bool:
        return self.s.startswith(literal, pos)

    def until(self, pos: int, *delimiters: str) -> int:
        """Up to the first delimiter, or to a tail of the text that begins one, or to the end."""
        found = [i for i in (self.s.find(d, pos) for d in delimiters) if i >= 0]
        if found:
            return min(found)
        for i in range(max(pos, self.end - max(map(len, delimiters)) + 1), self.end):
            if any(d.startswith(self.s[i:]) for d in delimiters):
                return i
        return self.end

    def space(self, pos: int) -> int:
        while pos < self.end and self.s[pos] in " \t\n\r":
            pos += 1
        return pos

    def answer(self) -> Message | None:
        msg, texts = Message(), []
        pos = self.lit(0, START)
        while pos is not None:   # reasoning messages, each followed by the next message's start
            after = self.analysis(pos, texts)
            if after is None or after == pos:
                break
            pos = self.lit(after, START)
        if pos is None:
            return None
        text = "".join(texts)
        if self.fmt.reasoning:
            msg.reasoning = text if text.strip(" \n\r\t") else ""
        else:
            msg.content = text
        calls = self.calls(pos) if self.fmt.tools else None
        if calls is not None:
            msg.tool_calls = calls[1]
            return msg
        if self.fmt.required:
            return None
        final = self.final(pos)
        if final is None:
            return None
        pos, content = final
        msg.content += content
        if self.fmt.tools and pos < self.end:   # "inform, then act": a call after the answer's <|eom|>
            after = self.lit(pos, EOM)
            after = self.lit(after, START) if after is not None else None
            calls = self.calls(after) if after is not None else None
            if calls is not None:
                msg.tool_calls = calls[1]
        return msg

    def analysis(self, pos: int, texts: list) -> int | None:
        head = self.lit(pos, " to=self" + MESSAGE)
        if head is None:
            return None
        stop = self.until(head, EOM)
        texts.append(self.s[head:stop])
        return self.lit(stop, EOM)

    def final(self, pos: int) -> tuple[int, str] | None:
        head = self.lit(pos, " to=user")
        head = self.lit(head if head is not None else pos, MESSAGE)
        if head is None:
            return None
        stop = self.until(head, EOT, EOM)
        return stop, self.s[head:stop]

    def calls(self, pos: int) -> tuple[int, list] | None:
        first = self.call(pos)
        if first is None:
            return None
        pos, calls = first[0], [first[1]] if first[1] is not None else []
        while self.fmt.parallel and pos < self.end:
            after = self.lit(pos, EOM)
            after = self.lit(after, START) if after is not None else None
            more = self.call(after) if after is not None else None
            if more is None:
                break
            pos = more[0]
            if more[1] is not None:
                calls.append(more[1])
        return pos, calls

    def call(self, pos: int) -> tuple[int, list | None] | None:
        """One call: (the position after it, [name, arguments], or None where the text ended
        before the tool's name was whole)."""
        head = self.lit(pos, " to=")
        if head is None:
            return None
        head = self.lit(self.until(head, MESSAGE), MESSAGE + "<atem:function_calls>")
        if head is None:
            return None
        head = self.lit(self.space(head), '<atem:invoke name="')
        if head is None:
            return None
        for name, tool in self.tools.items():   # llama.cpp tries the tools in order: the first that fits
            after = self.lit(head, name)
            if after is None:
                continue
            after = self.lit(after, '">')
            if after is None:
                continue
            if not self.whole(head, name + '">'):
                return self.end, None
            got = self.arguments(self.space(after), tool)
            if got is not None:
                return got[0], [name, got[1]]
        return None

    def arguments(self, pos: int, tool: Tool) -> tuple[int, str] | None:
        """The parameters up to the invoke's close -> (the position after the call, the arguments
        as llama.cpp's mapper writes them: string values JSON-quoted, others as written)."""
        out = "{"
        first = True
        while pos < self.end:
            head = self.lit(pos, '<atem:parameter name="')
            if head is None:
                break
            got = None
            for name in tool.parameters.get("properties", {}):
                after = self.lit(head, name)
                if after is None:
                    continue
                if not self.whole(head, name):
                    return self.end, out
                key = ("" if first else ",") + json.dumps(name, ensure_ascii=False) + ":"
                after = self.lit(after, '">')
                if after is None:
                    continue
                if not self.whole(after - 2, '">'):
                    return self.end, out
                if name in tool.strings:
                    stop = self.until(after, ARG_CLOSE)
                    value = '"' + json.dumps(self.s[after:stop], ensure_ascii=False)[1:-1]
                    if self.whole(stop, ARG_CLOSE):
                        got = (self.space(stop + len(ARG_CLOSE)), key + value + '"')
                    else:
                        return self.end, out + key + value
                elif after == self.end:
                    return self.end, out + key
                else:
                    stop = _json_end(self.s, after)
                    if stop is None:
                        if _json_prefix(self.s[after:]):
                            return self.end, out + key + self.s[after:]
                        continue
                    close = self.lit(stop, ARG_CLOSE)
                    if close is None:
                        continue
                    if not self.whole(stop, ARG_CLOSE):
                        return self.end, out + key + self.s[after:stop]
                    got = (self.space(close), key + self.s[after:stop])
                break
            if got is None:
                if head == self.end:
                    return self.end, out
                return None
            pos, piece = got
            out += piece
            first = False
        close = self.lit(pos, "</atem:invoke>")
        if close is None:
            return None
        if not self.whole(pos, "</atem:invoke>"):
            return self.end, out
        start = self.space(close)
        close = self.lit(start, "</atem:function_calls>")
        if close is None:
            return None
        return close, out + ("}" if self.whole(start, "</atem:function_calls>") else "")


def _json_end(s: str, pos: int) -> int | None:
    """Where the JSON value at s[pos:] ends (none may start with whitespace), or None."""
    if pos >= len(s) or s[pos].isspace():
        return None
    try:
        _, end = json.JSONDecoder(strict=True).raw_decode(s, pos)
    except (ValueError, RecursionError):
        return None
    return end


def _json_prefix(text: str) -> bool:
    """Whether a text is the start of a JSON value cut by the end of the answer."""
    if not text or text[0].isspace():
        return False
    if any(word.startswith(text) for word in ("true", "false", "null")):
        return True
    try:
        json.JSONDecoder(strict=True).raw_decode(text)
    except json.JSONDecodeError as exc:
        return exc.pos >= len(text) or exc.msg.startswith("Unterminated string")
    except (ValueError, RecursionError):
        return False
    return False
