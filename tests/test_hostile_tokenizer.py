"""The vocabulary and chat template as untrusted input (issue 19).

Every failure is one TokenizerError (or ArtifactError, for bytes that are not UTF-8) naming
what was wrong: never a tokenizers panic, a jinja2 traceback, a hang or a runaway render.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from gguf import GGUFValueType as VT

import muse_mlx.tokenizer as tokenizer_module
from mutate import Layout, enc_array, enc_string_value, splice_kv
from muse_mlx.artifact import open_artifact
from muse_mlx.errors import ArtifactError, TokenizerError
from muse_mlx.tokenizer import MuseTokenizer, render_chat_template

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def vocab(f32_fixture):
    return open_artifact(f32_fixture).vocabulary


def one_line(exc_info, *fragments):
    msg = str(exc_info.value)
    assert "\n" not in msg and "Traceback" not in msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


# ---- the vocabulary -----------------------------------------------------------------------


def test_duplicate_token_strings(vocab):
    tokens = list(vocab.tokens)
    tokens[300] = tokens[7]
    with pytest.raises(TokenizerError) as info:
        MuseTokenizer(replace(vocab, tokens=tokens))
    one_line(info, "token 300", "repeats token 7", "unique")


@pytest.mark.parametrize("merge,fragment", [
    ("zz", "not two tokens"),  # no space: was a TypeError
    ("a b c", "not two tokens"), ("a  b", "not two tokens"), (" a", "not two tokens"), ("", "not two tokens"),
    ("zz yy", "'zz', which is not in the vocabulary"),  # was tokenizers' "Token 'zz' out of vocabulary"
])
def test_bad_merges(vocab, merge, fragment):
    merges = list(vocab.merges)
    merges[3] = merge
    with pytest.raises(TokenizerError) as info:
        MuseTokenizer(replace(vocab, merges=merges))
    one_line(info, "tokenizer.ggml.merges", "merge 3", fragment)


def test_merge_whose_result_is_unknown(vocab):
    tokens = list(vocab.tokens)
    a, b = vocab.merges[0].split(" ")
    tokens[tokens.index(a + b)] = "<|renamed|>"
    with pytest.raises(TokenizerError) as info:
        MuseTokenizer(replace(vocab, tokens=tokens))
    one_line(info, "merge 0", repr(a + b), "not in the vocabulary")


@pytest.mark.parametrize("key,index", [("tokenizer.ggml.tokens", 40), ("tokenizer.ggml.merges", 2)])
def test_invalid_utf8_in_the_vocabulary(f32_fixture, tmp_path, key, index):
    data = f32_fixture.read_bytes()
    e = Layout.of(data).kv[key]
    import struct
    items = [data[p + 8:p + 8 + struct.unpack_from("<Q", data, p)[0]] for p in e.elements]
    items[index] = b"\xc3("
    p = tmp_path / "utf8.gguf"
    p.write_bytes(splice_kv(data, key, enc_array(VT.STRING, items)))
    a = open_artifact(p)  # the vocabulary is read when it is first needed
    with pytest.raises(ArtifactError) as info:
        a.vocabulary
    one_line(info, f"'{key}' element {index}", "valid UTF-8", "0xc3")


# ---- the chat template: reading and compiling -----------------------------------------------


def with_template(f32_fixture, tmp_path, template: bytes) -> MuseTokenizer:
    p = tmp_path / "template.gguf"
    p.write_bytes(splice_kv(f32_fixture.read_bytes(), "tokenizer.chat_template", enc_string_value(template)))
    return MuseTokenizer(open_artifact(p).vocabulary)


def test_invalid_utf8_template_only_matters_for_chat(f32_fixture, tmp_path):
    """Was a UnicodeDecodeError at load, even without --chat. Now plain prompts work and chat
    says what is wrong with the template."""
    tok = with_template(f32_fixture, tmp_path, b"{{ messages[0].content }}\xff\xfe")
    assert tok.decode(tok.encode("plain prompt", add_bos=False)) == "plain prompt"
    with pytest.raises(TokenizerError) as info:
        tok.apply_chat_template(USER)
    one_line(info, "chat template (tokenizer.chat_template)", "valid UTF-8", "0xff")


@pytest.mark.parametrize("template", ["{% for %}", "{{ x ", "{% if %}{% endfor %}", "{{ " + "(" * 5000 + " }}"])
def test_template_that_does_not_compile(f32_fixture, tmp_path, template):
    tok = with_template(f32_fixture, tmp_path, template.encode())
    with pytest.raises(TokenizerError) as info:
        tok.apply_chat_template(USER)
    one_line(info, "chat template (tokenizer.chat_template)")


def test_template_over_the_size_bound():
    with pytest.raises(TokenizerError) as info:
        render_chat_template("x" * (tokenizer_module.TEMPLATE_MAX_BYTES + 1), USER)
    one_line(info, "characters long")


# ---- the chat template: rendering ----------------------------------------------------------


@pytest.mark.parametrize("name,template,fragment", [
    ("ZeroDivisionError", "{{ 1 / 0 }}", "ZeroDivisionError"),
    ("TypeError", "{{ 1 + 'a' }}", "TypeError"),
    ("RecursionError", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested more than"),
    ("OverflowError", "{{ 10.0 ** 400 }}", "OverflowError"),
    ("MemoryError", "{{ 'x' * 10 ** 12 }}", "exceeds the limit"),
    ("huge power", "{{ 10 ** 100000000 }}", "too large"),
    ("huge list", "{{ ([0] * 10 ** 9) | length }}", "exceeds the limit"),
    ("huge width", "{{ 'x' | center(10 ** 9) }}", "more than"),
    ("huge %-format", "{{ '%2000000000d' % 1 }}", "million"),
    ("huge str.format", "{{ '{:>2000000000}'.format(1) }}", "million"),
    ("doubling namespace", "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                           "{% endfor %}{{ ns.s | length }}", "exceeds the limit"),
    ("doubling macro", "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ d('x', 64) }}",
     "exceeds the limit"),
    ("huge output", "{% for i in range(100000) %}{% for j in range(100000) %}0123456789{% endfor %}{% endfor %}",
     "output passed"),
    ("raise_exception", "{{ raise_exception('no tools here') }}", "no tools here"),
    ("undefined", "{{ nothing() }}", "undefined"),
])
def test_render_errors_are_one_line(name, template, fragment):
    t = time.perf_counter()
    with pytest.raises(TokenizerError) as info:
        render_chat_template(template, USER, bos_token="<|bos|>", eos_token="<|eot|>")
    one_line(info, "chat template (tokenizer.chat_template)", fragment)
    assert time.perf_counter() - t < 3.0, name


def test_render_error_names_the_line():
    with pytest.raises(TokenizerError) as info:
        render_chat_template("line one\n{{ messages[0].content }}\n{{ 1 / 0 }}\n", USER)
    one_line(info, "at line 3", "ZeroDivisionError")


@pytest.mark.parametrize("payload", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ self._TemplateReference__context }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% set x = messages.append(1) %}",
    "{{ lipsum.__globals__['os'] }}",
])
def test_sandbox_still_blocks_code_execution(payload):
    try:
        out = render_chat_template(payload, USER)
    except TokenizerError as exc:
        assert "\n" not in str(exc)
    else:
        assert "uid=" not in out and "module 'os'" not in out


def test_render_is_bounded_in_time(monkeypatch):
    """A loop that emits and calls nothing is stopped by the watchdog."""
    monkeypatch.setattr(tokenizer_module, "TEMPLATE_SECONDS", 0.5)
    t = time.perf_counter()
    with pytest.raises(TokenizerError) as info:
        render_chat_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                             USER)
    one_line(info, "took longer than 0.5 s")
    assert time.perf_counter() - t < 3.0
    time.sleep(0.7)  # a stale watchdog must not fire into whatever runs next
    assert render_chat_template("{{ messages[0].content }}", USER) == "hi"


def test_watchdog_is_per_thread(monkeypatch):
    """Rendering in a worker thread is bounded too, and does not disturb the main thread."""
    monkeypatch.setattr(tokenizer_module, "TEMPLATE_SECONDS", 0.5)
    errors = []

    def work():
        try:
            render_chat_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                                 USER)
        except TokenizerError as exc:
            errors.append(str(exc))

    th = threading.Thread(target=work)
    th.start()
    th.join(5)
    assert not th.is_alive() and errors and "took longer" in errors[0]


def test_output_bound_scales_with_the_messages():
    """A long conversation is not cut by the 1 MiB bound: the bound grows with the input."""
    long = [{"role": "user", "content": "x" * (2 << 20)}]
    assert len(render_chat_template("{{ messages[0].content }}", long)) == 2 << 20


def test_fixture_template_still_renders(vocab):
    tok = MuseTokenizer(vocab)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}] + USER)
    assert text.endswith("<|start|>assistant")
    assert tok.apply_chat_template(USER) == tok.apply_chat_template(USER)  # compiled once, reused
