"""Constrained output (muse_mlx/grammar.py): a grammar's greedy output against the pinned llama.cpp's
own grammar sampler, a schema's output against Python's JSON parser, the sampler's order, and the
CLI's refusals. The server's side is in tests/test_server.py. Fixtures are synthetic."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx.artifact import open_artifact
from muse_mlx.grammar import Grammars, GrammarError, grammar_of
from muse_mlx.sampling import Sampler, SamplerSettings
from muse_mlx.tokenizer import MuseTokenizer

PROMPT = "The cache keeps what"
# Grammars whose greedy paths cross words, character classes, repetition bounds and the grammar's
# end (the second one ends: llama.cpp then allows only an end-of-generation token).
GRAMMARS = [
    'root ::= ("the" | "a") " " [a-z]+ (" " [a-z]+)* "."',
    'root ::= [0-9]{2,4} "-" [A-Z]+ ws "end"\nws ::= [ \\t\\n]*',
    'root ::= "{" pair ("," pair)* "}"\npair ::= "\\"" [a-z]+ "\\":" [0-9]+',
    # llama.cpp's token references: by id, by text (special tokens parsed), and negated (any token but it)
    'root ::= [a-z]+ " " <[4]> word <|start|> word " " <|eot|>\nword ::= [a-z]+ ("-" [a-z]+)?',
    'root ::= <[510]> !<[4]>{3,5} <[511]> [a-z ]+ "."',
    'root ::= <|start|> !<[508]>{2,6} <|message|> [a-z ]+ "."',
    # groups whose one item is repeated, under a repetition (llguidance's converter unwrapped them into
    # Lark it cannot parse)
    'root ::= ("e"{0,2}){1,3} " " ([a-z]+)? (" " ([a-z]{1,3})+)* "."',
]


def generate(model, *args, n=30, prompt=PROMPT):
    return subprocess.run([sys.executable, "-m", "muse_mlx.generate", "--model", str(model), "--temp", "0",
                           "--prompt", prompt, "--max-tokens", str(n), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(f32_fixture):
    return MuseTokenizer(open_artifact(f32_fixture).vocabulary)


@pytest.mark.parity
@pytest.mark.parametrize("gbnf", GRAMMARS)
def test_greedy_under_a_grammar_matches_llama_cpp(f32_fixture, gbnf):
    """The CLI's greedy text under --grammar equals a greedy loop over the pinned llama.cpp's logits
    with its own grammar sampler (llama_sampler_init_grammar) applied before each argmax."""
    from muse_mlx.tools.llamacpp import LlamaCpp

    with LlamaCpp(f32_fixture, n_ctx=256) as llama:
        ids = llama.grammar_greedy(llama.tokenize(PROMPT), 30, gbnf)
        want = llama.detokenize(ids).decode("utf-8", errors="replace")
        free = llama.detokenize(llama.greedy(llama.tokenize(PROMPT), 8)).decode("utf-8", errors="replace")
    r = generate(f32_fixture, "--grammar", gbnf)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert not r.stdout.startswith(free[:4])   # the grammar changed the answer


def test_a_negated_class_gives_text_of_the_grammar(f32_fixture):
    """`[^a-e]` is a class of characters: the output is UTF-8 text in it. (The pinned llama.cpp's
    grammar sampler also takes byte sequences past U+10FFFF as "characters" of such a class and
    prints bytes that are not UTF-8 there: ledger, 2026-12-05.)"""
    r = subprocess.run([sys.executable, "-m", "muse_mlx.generate", "--model", str(f32_fixture), "--temp", "0",
                        "--prompt", PROMPT, "--max-tokens", "30", "--grammar", 'root ::= [^a-e]+ "!"'],
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode("utf-8")[:-1]   # strict: not UTF-8 fails here
    assert re.fullmatch(r"[^a-e]+!?", text), text


def test_a_schema_gives_json_it_accepts(f32_fixture):
    """--json-schema: the text is JSON that the schema accepts (Python's parser the judge), and the
    run ends where the object does."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}, "pick": {"enum": ["red", "blue"]}},
              "required": ["n", "ok", "pick"], "additionalProperties": False}
    r = generate(f32_fixture, "--json-schema", json.dumps(schema), n=60)
    assert r.returncode == 0, r.stderr
    value = json.loads(r.stdout)
    assert set(value) == {"n", "ok", "pick"} and 0 <= value["n"] <= 99 and isinstance(value["n"], int)
    assert isinstance(value["ok"], bool) and value["pick"] in ("red", "blue")
    assert "stopped by the grammar's end" in r.stderr


def test_grammar_files_and_refusals(f32_fixture, tmp_path):
    """The file forms read as the flags; a grammar that does not compile, a missing, non-UTF-8 or
    non-regular file, and two grammars at once are one line and exit 2, before the weights load."""
    g = tmp_path / "yes.gbnf"
    g.write_text('root ::= "yes" | "no"')
    r = generate(f32_fixture, "--grammar-file", str(g))
    assert r.returncode == 0 and r.stdout in ("yes\n", "no\n"), r.stderr
    s = tmp_path / "s.json"
    s.write_text('{"enum": [1, 2, 3]}')
    r = generate(f32_fixture, "--json-schema-file", str(s))
    assert r.returncode == 0 and r.stdout in ("1\n", "2\n", "3\n"), r.stderr
    bad = tmp_path / "bad.gbnf"
    bad.write_bytes(b'root ::= "\xff"')
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args, fragment in [(["--grammar", "root ::= foo"], "--grammar does not compile: "),
                           (["--grammar", "root ::= [z-a]"], "--grammar does not compile: "),
                           (["--json-schema", "[1"], "--json-schema does not compile: "),
                           (["--json-schema", '{"type": 5}'], "--json-schema does not compile: "),
                           (["--grammar-file", str(tmp_path / "none")], "--grammar-file"),
                           (["--grammar-file", str(bad)], "not UTF-8"),
                           (["--json-schema-file", str(fifo)], "not a regular file"),
                           (["--grammar", 'root ::= "a"', "-j", "{}"], "not allowed with"),
                           (["--grammar", "root ::= <[12"], "has no closing '>'"),
                           (["--grammar", "root ::= <[1x]>"], "is not <[id]>"),
                           (["--grammar", "root ::= <>"], "an empty token reference"),
                           (["--grammar", "root ::= <[99999999999]>"], "is too big")]:
        r = generate(f32_fixture, *args)
        assert r.returncode == 2, (args, r.stderr)
        assert fragment in r.stderr and "Traceback" not in r.stderr and "load" not in r.stderr, (args, r.stderr)


def test_token_references_are_looked_up_in_the_vocabulary(f32_fixture, tokenizer):
    """A token named by text must be one token of the vocabulary and an id must be in it: one line,
    exit 2 (after the weights load: the vocabulary decides); references written alike share a rule."""
    for gbnf, fragment in [("root ::= <hello>", "<hello> is not one token of the vocabulary"),
                           ("root ::= !<[600]>", "token 600 (!<[600]>) is past the vocabulary's 512 tokens")]:
        r = generate(f32_fixture, "--grammar", gbnf)
        assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr, r.stderr
    text = grammar_of("gbnf", "root ::= " + " ".join(["<[5]>"] * 1000) + " !<[5]> <|message|>", "g", Grammars(tokenizer))
    assert text.count("muse_token_ref_0:") == 1 and "muse_token_ref_2: <[511]>" in text


def test_fuzzed_token_references_are_refused_in_one_line(tokenizer):
    """3,000 random GBNF texts built of token references and their look-alikes: each compiles or is a
    one-line GrammarError (was: a reference's text with a newline in it made a two-line message)."""
    import random

    grammars = Grammars(tokenizer)
    rng = random.Random(7)
    pieces = ['<', '>', '!', '[', ']', '<[', ']>', '<|message|>', '<|eot|>', '<[4]>', '!<[4]>', '<[511]>', '<[9999]>',
              '"a"', '"<x>"', '[a-z]', ' ', '\n', '#c\n', '(', ')', '*', '+', '?', '{2}', '|', 'x', 'x ::= ', '\\', '"',
              '0', '<hello>', '<>', '!<']
    compiled = 0
    for _ in range(3000):
        text = "root ::= " + "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        try:
            grammars.compile("gbnf", text, "g")
            compiled += 1
        except GrammarError as exc:
            assert "\n" not in str(exc) and len(str(exc)) < 500, (text, str(exc))
    assert compiled > 100   # the texts reach the matcher, not only the scan


def test_the_grammar_masks_before_the_filters(tokenizer):
    """llama.cpp resamples a rejected token with the grammar applied first, so top-k sees only the
    allowed tokens: with top_k = 1 the pick is the best allowed token, never a disallowed argmax."""
    grammars = Grammars(tokenizer)
    yes, no = tokenizer.encode("yes", add_bos=False)[0], tokenizer.encode("no", add_bos=False)[0]
    logits = np.zeros(tokenizer.n_vocab, dtype=np.float32)
    logits[5], logits[yes], logits[no] = 10.0, 1.0, 2.0   # token 5 is the argmax; the grammar forbids it
    for settings in (SamplerSettings(temp=0.0), SamplerSettings(temp=1.0, top_k=1, seed=3),
                     SamplerSettings(temp=1.0, top_p=0.01, seed=3)):
        sampler = Sampler(settings, constraint=grammars.compile("gbnf", 'root ::= "yes" | "no"', "g"))
        assert sampler(mx.array(logits)) == no, settings


def test_a_constraint_follows_the_tokens_read(tokenizer):
    """The mask moves with the tokens read; a copy keeps its own state; the end is the grammar's."""
    grammars = Grammars(tokenizer)
    c = grammars.compile("gbnf", 'root ::= "ab" "c"', "g")
    first = np.array(c.allowed(tokenizer.n_vocab))
    twin = c.copy()
    for t in tokenizer.encode("abc", add_bos=False):
        assert np.array(c.allowed(tokenizer.n_vocab))[t]
        c.read(t)
    assert c.done and not twin.done
    assert (np.array(twin.allowed(tokenizer.n_vocab)) == first).all()
    assert np.flatnonzero(np.array(c.allowed(tokenizer.n_vocab))).tolist() == sorted(tokenizer.stop_ids)
    with pytest.raises(GrammarError):
        twin.read(tokenizer.encode("c", add_bos=False)[0])   # not a prefix of the grammar's text


@pytest.mark.parametrize("kind,text", [("gbnf", "root ::= " + "(" * 5000 + '"a"' + ")" * 5000),
                                       ("gbnf", "\n".join(f"r{i} ::= r{i + 1} r{i + 1}" for i in range(60))
                                        + '\nr60 ::= "a"\nroot ::= r0'),
                                       ("json_schema", '{"type":"array","items":' * 900 + "{}" + "}" * 900),
                                       ("gbnf", 'root ::= "' + "a" * 300_000 + '"')])
def test_hostile_grammars_are_refused_in_one_line(kind, text):
    """Nesting past the converter's depth, a grammar that expands past llguidance's size bound, a
    schema nested past its depth and a text past 256 KiB: each a GrammarError, none a crash."""
    with pytest.raises(GrammarError) as exc:
        grammar_of(kind, text, "g")
    assert "\n" not in str(exc.value) and len(str(exc.value)) < 400
