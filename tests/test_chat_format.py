"""muse-glimmer's chat format (muse_mlx/chat_format.py) against the pinned llama.cpp's chat layer,
built from the sdist (tests/chat_oracle.py): the answer's parse under every reasoning format and
tool choice, on generated and cut answers; the tool-call grammar's verdicts beside llama.cpp's
parser's; and, without the oracle, the request's reading, the lazy grammar's trigger and the stream
of deltas."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import chat_oracle
from muse_mlx.artifact import open_artifact
from muse_mlx.chat_format import (TRIGGER, AnswerStream, ChatFormat, FormatError, Message, read_format, read_tools,
                                  tools_grammar)
from muse_mlx.grammar import GrammarError, Grammars
from muse_mlx.tokenizer import MuseTokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "opts": {"type": "object"}, "x": {"type": ["string", "null"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get", "parameters": {"type": "object",
                                                                    "properties": {"q": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "noargs", "parameters": {}}},
]
STRINGS = ["Rome", "a b", "", " sp ", "x\ny", 'é"\\', "<b>", "null", "東京 🚀"]
NUMBERS = ["3", "-1", "3.5", "x", " 3", "1e3", "3 "]
OBJECTS = ['{"a": 1}', "{}", "[1]", '{"a": [1, {"b": null}]}', '{"a"', "tru"]


def _value(rng, name):
    return rng.choice(STRINGS if name in ("city", "q", "x") else NUMBERS if name == "days" else OBJECTS)


def _call(rng, seps=("\n", "", " ", "\n\n", "\t"), named=0.9):
    fn = rng.choice(TOOLS)["function"]
    name = fn["name"] if rng.random() < named else "unknown"
    sep = rng.choice(seps)
    props = list(fn.get("parameters", {}).get("properties", {}))
    params = "".join(f'<atem:parameter name="{k}">{_value(rng, k)}</atem:parameter>{sep}'
                     for k in rng.sample(props, rng.randint(0, len(props))))
    recipient = rng.choice([name, "functions." + name, "x"])
    return (f" to={recipient}<|message|><atem:function_calls>{sep}<atem:invoke name=\"{name}\">{sep}{params}"
            f"</atem:invoke>{sep}</atem:function_calls>")


def _answer(rng):
    """An answer as the model might write it (reasoning, an answer, calls, noise), cut half the time."""
    parts = [" to=self<|message|>" + rng.choice(["think", "a<b", "", "x <atem:function_calls>", " \n"]) +
             "<|eom|><|start|>assistant" for _ in range(rng.choice([0, 0, 1, 2]))]
    r = rng.random()
    if r < 0.4:
        parts.append(_call(rng))
    elif r < 0.8:
        parts.append(rng.choice([" to=user", ""]) + "<|message|>" + rng.choice(["Hello", "", "a<|x|>", "x\n"]) +
                     rng.choice(["<|eot|>", "<|eom|>", ""]))
        if rng.random() < 0.3:
            parts.append("<|start|>assistant" + _call(rng))
    else:
        parts.append(rng.choice(["noise", "  to=user<|message|>x", " to=selfish<|message|>x", " to=user <|message|>"]))
    if rng.random() < 0.2:
        parts.append(rng.choice(["<|eom|><|start|>assistant" + _call(rng), "junk"]))
    text = "".join(parts)
    return text[:rng.randint(0, len(text))] if rng.random() < 0.5 else text


def _oracle_request(oracle, texts, reasoning, tools, choice, parallel):
    request = {"template": chat_oracle.template(), "bos": "<|bos|>", "eos": "<|eot|>",
               "messages": [{"role": "user", "content": "hi"}], "reasoning_format": reasoning, "parse": texts,
               "tool_choice": choice, "parallel_tool_calls": parallel}
    if tools:
        request["tools"] = tools
    return oracle.apply(request)


def _theirs(parsed: dict):
    if "error" in parsed:
        return None
    return (parsed.get("content") or "", parsed.get("reasoning_content") or "",
            [[c["function"]["name"], c["function"]["arguments"]] for c in parsed.get("tool_calls", [])])


@pytest.fixture(scope="module")
def oracle():
    o = chat_oracle.oracle()
    if o is None:
        pytest.skip("the chat oracle needs the pinned sdist, the parity extra and a C++ compiler")
    return o


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("reasoning", ["auto", "none", "deepseek", "deepseek-legacy"])
def test_the_answer_reads_as_llama_cpp_reads_it(oracle, reasoning):
    rng = random.Random(f"answers-{reasoning}")
    texts = [_answer(rng) for _ in range(250)]
    checked = failed = 0
    for tools, choice in ((TOOLS, "auto"), (None, "auto"), (TOOLS, "required"), (TOOLS, "none")):
        for parallel in (False, True):
            theirs = _oracle_request(oracle, texts, reasoning, tools, choice, parallel)["parsed"]
            offered = read_tools(tools) if tools and choice != "none" else ()
            fmt = ChatFormat(offered, reasoning != "none", choice == "required" and bool(offered), parallel)
            for text, parsed in zip(texts, theirs):
                mine = fmt.parse(text)
                assert (None if mine is None else (mine.content, mine.reasoning, mine.tool_calls)) == _theirs(parsed), \
                    (reasoning, choice, parallel, text)
                checked += 1
                failed += mine is None
    # the corpus exercises both outcomes: answers llama.cpp reads, and answers it refuses
    assert checked == 8 * len(texts) and 0 < failed < checked // 2


@pytest.fixture(scope="module")
def tokenizer(f32_fixture):
    return MuseTokenizer(open_artifact(f32_fixture).vocabulary)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer)


def _follows(constraint, tokenizer, text) -> bool:
    """Whether a constraint takes the text's tokens one by one and may then end: nothing can follow,
    or an end-of-generation token may (with parallel calls an <|eom|> may also start another)."""
    try:
        for token in tokenizer.encode(text, add_bos=False):
            allowed = constraint.allowed(tokenizer.n_vocab)
            if allowed is not None and not bool(np.array(allowed)[token]):
                return False
            constraint.read(token)
        if constraint.done:
            return True
        allowed = constraint.allowed(tokenizer.n_vocab)
    except GrammarError:
        return False
    return allowed is not None and bool(np.array(allowed)[tokenizer.vocab.eot_id])


@pytest.mark.parity
def test_the_tool_grammar_takes_the_calls_llama_cpp_reads_and_refuses_the_others(oracle, tokenizer, grammars):
    """Whole calls with llama.cpp's spacing (its grammar's `space`): a call llama.cpp's parser reads
    whole, its values of their schema's type, our grammar takes; one llama.cpp's parser refuses,
    our grammar refuses too."""
    fmt, _ = read_format({"tools": TOOLS, "tool_choice": "required"})
    text = tools_grammar(fmt, grammars.special_id)
    rng = random.Random("calls")
    calls = [_call(rng, seps=("\n", "", " ", "\n\n"), named=0.8) for _ in range(120)]
    theirs = _oracle_request(oracle, calls, "auto", TOOLS, "required", False)["parsed"]
    taken = refused = 0
    for call, parsed in zip(calls, theirs):
        ours = _follows(grammars.compile("lark", text, "tools"), tokenizer, call)
        got = _theirs(parsed)
        if got is None:
            assert not ours, call
            refused += 1
            continue
        (name, arguments), = got[2]
        schema = next(t["function"] for t in TOOLS if t["function"]["name"] == name)["parameters"]
        kinds = {k: s["type"] if isinstance(s["type"], str) else "" for k, s in schema.get("properties", {}).items()}
        typed = all(isinstance(v, {"integer": int, "object": dict}.get(kinds[k], object)) and not isinstance(v, bool)
                    for k, v in json.loads(arguments).items())
        if typed:
            assert ours, call
            taken += 1
    assert taken >= 20 and refused >= 10


def test_the_lazy_grammar_holds_only_a_call(tokenizer, grammars):
    fmt, _ = read_format({"tools": TOOLS})
    text = tools_grammar(fmt, grammars.special_id)
    lazy = grammars.lazy("lark", text, "tools", TRIGGER, ">")
    for token in tokenizer.encode(" to=user<|message|>any <atem:parameter text", add_bos=False):
        assert lazy.allowed(tokenizer.n_vocab) is None   # the answer, reasoning: nothing held
        lazy.read(token)
    assert not lazy.done
    reasoning = grammars.lazy("lark", text, "tools", TRIGGER, ">")
    for token in tokenizer.encode(" to=self<|message|>thinking", add_bos=False):
        reasoning.read(token)
    assert reasoning.allowed(tokenizer.n_vocab) is None
    call = grammars.lazy("lark", text, "tools", TRIGGER, ">")
    head = " to=get<|message|>"
    for token in tokenizer.encode(head, add_bos=False):
        assert call.allowed(tokenizer.n_vocab) is None
        call.read(token)
    allowed = np.array(call.allowed(tokenizer.n_vocab))   # triggered: the call's markup is held
    assert 0 < allowed.sum() < 5 and tokenizer.decode([int(np.argmax(allowed))]) == "<"
    twin = call.copy()
    rest = '<atem:function_calls>\n<atem:invoke name="get">\n<atem:parameter name="q">x</atem:parameter>\n' \
           '</atem:invoke>\n</atem:function_calls>'
    assert _follows(call, tokenizer, rest)
    assert not _follows(twin, tokenizer, rest.replace('"get"', '"unknown"'))   # the copy kept its own state


def test_the_request_s_tools_and_options_are_read_or_refused_by_name():
    fmt, offered = read_format({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get"}}})
    assert [t.name for t in fmt.tools] == ["get"] and fmt.required and len(offered) == 3
    fmt, offered = read_format({"tools": TOOLS, "tool_choice": "none", "reasoning_format": "none"})
    assert fmt.tools == () and len(offered) == 3 and not fmt.structured
    assert read_format({}, "none")[0].reasoning is False and read_format({})[0].reasoning is True
    assert read_format({"tools": TOOLS})[0].parallel and not read_format({"tools": TOOLS, "parallel_tool_calls": False})[0].parallel
    assert read_tools(TOOLS)[0].strings == {"city", "x"}
    bad = [({"tools": {}}, "tools"), ({"tools": [{"type": "code"}]}, "tools"),
           ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
           ({"tools": [{"type": "function", "function": {"name": 'a"b'}}]}, "tools"),
           ({"tools": TOOLS[:1] * 2}, "tools"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]}, "tools"),
           ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
           ({"reasoning_format": "think"}, "reasoning_format")]
    for body, param in bad:
        with pytest.raises(FormatError) as err:
            read_format(body)
        assert err.value.param == param, body


def test_the_stream_s_deltas_add_up_to_the_answer():
    fmt, _ = read_format({"tools": TOOLS})
    text = (" to=self<|message|>Let me look.<|eom|><|start|>assistant to=user<|message|>Checking.<|eom|>"
            '<|start|>assistant to=get<|message|><atem:function_calls>\n<atem:invoke name="get">\n'
            '<atem:parameter name="q">rain in Rome</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')
    ids = iter(f"call_{i}" for i in range(9))
    stream = AnswerStream(fmt, lambda: next(ids))
    reasoning, content, calls = "", "", {}
    for i in range(0, len(text), 3):   # the text in pieces of three characters
        for delta in stream.push(text[i:i + 3]):
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call["function"].get("arguments", "")
    assert stream.message() == fmt.parse(text) == Message("Checking.", "Let me look.", [["get", '{"q":"rain in Rome"}']])
    assert (reasoning, content) == ("Let me look.", "Checking.")
    assert calls == {0: {"id": "call_0", "name": "get", "arguments": '{"q":"rain in Rome"}'}}
    noise = AnswerStream(fmt, lambda: "x")   # text that does not follow the format is the content
    assert [d["content"] for d in noise.push("plain") + noise.push(" text")] == ["plain", " text"]
    assert noise.message() == Message("plain text")


SCHEMAS = [{"type": "string"}, {"type": "integer"}, {}, {"type": ["null", "string"]}, {"type": ["null", "number"]},
           {"const": "a"}, {"const": 1}, {"enum": [1, "a"]}, {"enum": [1, 2]}, {"anyOf": [{"type": "integer"}, {"type": "string"}]},
           {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, {"pattern": "^a"}, {"maxLength": 3}, {"format": "date"},
           {"format": "email"}, {"allOf": [{"type": "string"}, {}]}, {"allOf": [{"type": "string"}, {"type": "integer"}]},
           {"allOf": [{}]}, {"type": "string", "allOf": [{"maxLength": 4}]}, {"$ref": "#/$defs/s"}, {"$ref": "#/$defs/n"},
           {"items": {"type": "string"}}, {"additionalProperties": False}, {"type": "object"}, {"$ref": "#/$defs/loop"}]


@pytest.mark.parity
def test_which_parameters_are_raw_text_is_llama_cpp_s_choice(oracle):
    """A parameter's value is raw text (JSON-quoted into the arguments) where llama.cpp's schema may
    be a string, else a JSON value: a value that is not JSON is read as text or refused as llama.cpp's
    parser reads or refuses it, for each kind of schema."""
    defs = {"s": {"type": "string"}, "n": {"type": "number"}, "loop": {"$ref": "#/$defs/loop"}}
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {"p": schema}, "$defs": defs}}} for i, schema in enumerate(SCHEMAS)]
    texts = [f' to=t{i}<|message|><atem:function_calls>\n<atem:invoke name="t{i}">\n'
             f'<atem:parameter name="p">abc</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
             for i in range(len(SCHEMAS))]
    theirs = _oracle_request(oracle, texts, "auto", tools, "auto", False)["parsed"]
    ours = read_tools(tools)
    verdicts = []
    for schema, tool, parsed in zip(SCHEMAS, ours, theirs):
        text = _theirs(parsed) is not None and _theirs(parsed)[2] == [[tool.name, '{"p":"abc"}']]
        assert ("p" in tool.strings) == text, schema
        verdicts.append(text)
    assert 5 <= sum(verdicts) <= len(SCHEMAS) - 5


def test_a_tool_s_refs_and_any_parameter_names_reach_its_grammar(tokenizer, grammars):
    """A parameter whose schema points into the tool's $defs, and parameter names that are not ASCII
    or hold spaces: the grammar compiles and takes a call of them, and refuses a value its schema
    refuses."""
    tools = [{"type": "function", "function": {"name": "plan", "parameters": {
        "type": "object", "$defs": {"day": {"type": "object", "properties": {"n": {"type": "integer"}},
                                            "required": ["n"], "additionalProperties": False}},
        "properties": {"jour é": {"$ref": "#/$defs/day"}, "ville": {"type": "string"}}}}}]
    fmt, _ = read_format({"tools": tools, "tool_choice": "required"})
    text = tools_grammar(fmt, grammars.special_id)
    call = (' to=plan<|message|><atem:function_calls>\n<atem:invoke name="plan">\n<atem:parameter name="jour é">'
            '{"n": 3}</atem:parameter>\n<atem:parameter name="ville">Lyon</atem:parameter>\n</atem:invoke>\n'
            '</atem:function_calls>')
    assert _follows(grammars.compile("lark", text, "tools"), tokenizer, call)
    assert fmt.parse(call).tool_calls == [["plan", '{"jour é":{"n": 3},"ville":"Lyon"}']]
    assert not _follows(grammars.compile("lark", text, "tools"), tokenizer, call.replace('{"n": 3}', '{"m": 3}'))
    # one call ends the answer without parallel calls; with them (the default) <|eom|> may start another
    for parallel in (False, True):
        fmt, _ = read_format({"tools": tools, "tool_choice": "required", "parallel_tool_calls": parallel})
        constraint = grammars.compile("lark", tools_grammar(fmt, grammars.special_id), "tools")
        for token in tokenizer.encode(call, add_bos=False):
            constraint.read(token)
        assert constraint.done is not parallel
        if parallel:
            assert bool(np.array(constraint.allowed(tokenizer.n_vocab))[tokenizer.vocab.eom_id])


CONTINUED = [
    # (the messages, continue_final_message as sent to llama.cpp's chat layer)
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The ring is"}], True),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "reasoning_content": "Let me think"}],
     True),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "So", "reasoning_content": "Hm."}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "two"}]}],
     "content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "reasoning_content": "Hm"}],
     "reasoning_content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A", "reasoning_content": "B"},
      {"role": "user", "content": "and?"}, {"role": "assistant", "content": "Well"}], True),
]


@pytest.mark.parity
@pytest.mark.parametrize("case", range(len(CONTINUED)))
@pytest.mark.parametrize("reasoning", ["auto", "none"])
def test_a_continued_answer_is_llama_cpp_s(oracle, f32_fixture, case, reasoning):
    """An assistant message continued (llama-server's continue_final_message, and what its
    prefill_assistant does with a last assistant message): the prompt equals llama.cpp's chat layer's
    (the messages before it rendered without the generation prompt, then the answer's start with the
    message in it), and answers generated after it read as llama.cpp's parser reads them (the message
    continued within the answer)."""
    from muse_mlx.chat_format import START, continuation, continued
    from muse_mlx.server import message_text

    messages, asked = CONTINUED[case]
    rng = random.Random(f"continued-{case}")
    texts = [_answer(rng)[:40] for _ in range(40)] + ["", " more<|eot|>", " and more", "<|eom|><|start|>assistant to=user<|message|>X"]
    theirs = oracle.apply({"template": chat_oracle.template(), "bos": "<|bos|>", "eos": "<|eot|>",
                           "messages": messages, "reasoning_format": reasoning, "add_generation_prompt": False,
                           "continue_final_message": asked, "parse": texts})
    mode = continuation({"messages": messages, "continue_final_message": asked, "add_generation_prompt": False}, True)
    last = messages[-1]
    prefill = continued(mode, last.get("reasoning_content") or "", message_text(last["content"], "\n\n"))
    tok = MuseTokenizer(open_artifact(f32_fixture).vocabulary, (chat_oracle.template(), "muse-glimmer.jinja"))
    shown = [{**m, "content": message_text(m["content"])} for m in messages[:-1]]
    assert tok.apply_chat_template(shown, add_generation_prompt=False) + START + prefill == theirs["prompt"]
    fmt = ChatFormat((), reasoning != "none", prefill=prefill)
    for text, parsed in zip(texts, theirs["parsed"]):
        mine = fmt.parse(text)
        assert (None if mine is None else (mine.content, mine.reasoning, mine.tool_calls)) == _theirs(parsed), text


def test_what_llama_server_refuses_of_a_continuation():
    from muse_mlx.chat_format import continuation

    user, asst = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}
    assert continuation({"messages": [user]}, True) is None
    assert continuation({"messages": [user, asst]}, False) is None   # --no-prefill-assistant
    assert continuation({"messages": [user, asst]}, True) == "content"
    assert continuation({"messages": [user, {"role": "assistant", "content": None, "reasoning_content": "r"}]},
                        True) == "reasoning"
    for body, says in [({"messages": [user, asst, asst]}, "2 or more assistant messages"),
                       ({"messages": [user, asst], "continue_final_message": True}, "add_generation_prompt"),
                       ({"messages": [user, asst], "continue_final_message": "all"}, "must be true, false"),
                       ({"messages": [user, {"role": "assistant", "content": "", "tool_calls": [{}]}]}, "tool calls")]:
        with pytest.raises(FormatError, match=says):
            continuation(body, True)
