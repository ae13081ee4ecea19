"""Constrained output: a grammar the generated text must follow (llama.cpp's --grammar and
--json-schema, OpenAI's response_format), through llguidance.

`Grammars` holds llguidance's view of one vocabulary and compiles a request's grammar (GBNF, a
JSON schema) into a `Constraint`: per request, the tokens allowed next (`allowed`, a bool row for
the sampler) and the tokens taken (`read`). docs/server.md, "Constrained output", gives the design.
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np

from .errors import MuseError

MAX_GRAMMAR_BYTES = 256 * 1024   # a grammar's or schema's text at most
# The whitespace a JSON schema's text may hold between its parts: llama.cpp's json-schema-to-grammar's
# `space` rule (nothing, a space, or one or two newlines and up to 20 spaces or tabs), where
# llguidance's own default takes any run of whitespace. A schema's "x-guidance" may set another.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"


class GrammarError(MuseError):
    """A grammar or schema that does not compile, or a constrained generation that cannot go on."""


def _llguidance():
    try:
        import llguidance
    except ImportError:   # a declared dependency: only a broken install lacks it
        raise GrammarError("constrained output needs llguidance (pip install llguidance)") from None
    return llguidance


class Grammars:
    """llguidance's token table for one tokenizer (made once: 0.3 s on this project's 2-core CPU for a
    synthetic vocabulary of 202,048, most of them control tokens; ledger 2026-12-05) and the compiler
    of grammars over it."""

    def __init__(self, tokenizer):
        llg = _llguidance()
        tokens = []
        self._special: dict[str, int] = {}   # the text of each token marked special -> its (lowest) id
        for i, text in enumerate(tokenizer.vocab.tokens):
            if i in tokenizer.special_ids:   # rendered raw, as llama.cpp's token_to_piece(special=true)
                raw = text.encode("utf-8", "surrogatepass")
                if i in tokenizer.control_ids or (raw.startswith(b"<") and raw.endswith(b">")):
                    raw = b"\xff" + raw   # llguidance's mark of a special token: no text matches it
                    self._special.setdefault(text, i)
                tokens.append(raw)
            else:
                tokens.append(tokenizer.token_bytes(i))
        stops = sorted(tokenizer.stop_ids)

        class Wrapper:   # what llguidance.TokenizerWrapper reads
            eos_token_id = stops[0] if stops else None
            bos_token_id = tokenizer.bos_id
            special_token_ids = sorted(tokenizer.special_ids)

            def __call__(self, data: bytes) -> list[int]:
                return tokenizer.encode(data.decode("utf-8", "replace"), add_bos=False)
        Wrapper.tokens = tokens
        self.n_vocab = len(tokens)
        self._llg = llg
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(Wrapper()), eos_token=stops or None)
        self._texts = [t[1:] if t.startswith(b"\xff") else t for t in tokens]
        self._encode = lambda text: tokenizer.encode(text, add_bos=False)
        self._stops = frozenset(stops)
        self._unfit: list[int] | None = None   # tokens a negated reference never matches (negated)

    def token_of(self, text: str) -> int | None:
        """A GBNF token reference's id: its text as one token, special tokens parsed (llama.cpp's parse_token)."""
        ids = self._encode(text)
        return ids[0] if len(ids) == 1 else None

    def negated(self, token: int) -> str:
        """llama.cpp's !<[id]> in llguidance's Lark: any one token but `token`, save those llama.cpp's
        grammar never takes where it names a token (llama_grammar_apply_impl): the end-of-generation
        tokens (the grammar's own end lets them), and tokens of no text, or whose text llama-grammar.cpp's
        decode_utf8 finds invalid or without a whole character (`_takes_at_token`)."""
        if self._unfit is None:
            self._unfit = [i for i, text in enumerate(self._texts) if i in self._stops or not _takes_at_token(text)]
        ids = sorted({token, *self._unfit})
        runs = []   # [first, last] of each run of consecutive ids
        for i in ids:
            if runs and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        return "<[^" + ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) + "]>"

    def special_id(self, text: str) -> int | None:
        """The id of a token with this text that the table marks special (a grammar names it
        <[id]>: its text is not matched by a grammar's text), or None."""
        return self._special.get(text)

    def lazy(self, kind: str, text: str, what: str, trigger: str, ends_with: str) -> "LazyConstraint":
        """A grammar that holds the output from where `trigger` (a regular expression over the text,
        special tokens shown, whose group 1 is where the grammar starts, and whose every match ends
        with the character `ends_with`) first matches it: llama.cpp's lazy grammars. Compiled now, so
        that a grammar that does not compile is refused before generation."""
        self.compile(kind, text, what)
        return LazyConstraint(self, kind, text, what, re.compile(trigger), ends_with.encode())

    def compile(self, kind: str, text: str, what: str) -> "Constraint":
        """A new constraint from a grammar (`grammar_of`'s arguments). GrammarError when it does not compile."""
        llg = self._llg
        matcher = llg.LLMatcher(self.tokenizer, grammar_of(kind, text, what, self), log_level=0,
                                limits=_limits(llg))
        if matcher.is_error():
            raise GrammarError(f"{what} does not compile: {_one_line(matcher.get_error())}")
        first = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)   # a grammar no text can start fails here
        if matcher.is_error() or not first.any():
            raise GrammarError(f"{what} admits no text: no token can start it")
        return Constraint(matcher, self.n_vocab, what)


def grammar_of(kind: str, text: str, what: str, vocab: "Grammars | None" = None) -> str:
    """llguidance's grammar from `kind` "gbnf" (the grammar's text) or "json_schema" (the schema's JSON
    text); `what` names it in an error. vocab: where a GBNF's token references are looked up
    (Grammars.token_of, n_vocab); without it (a CLI refusing a grammar before the weights load) a
    reference is only checked for its form. GrammarError when it does not compile."""
    llg = _llguidance()
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{what} is more than {MAX_GRAMMAR_BYTES // 1024} KiB")
    try:
        if kind == "gbnf":
            gbnf, refs = _prepare_gbnf(text, what)
            grammar = _with_tokens(llg.grammar_from("gbnf", gbnf), refs, what, vocab)
        elif kind == "lark":
            grammar = llg.grammar_from(kind, text)
        elif kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_pattern": JSON_WHITESPACE})
        else:
            raise ValueError(f"unknown grammar kind {kind!r}")
    except (ValueError, RecursionError) as exc:
        raise GrammarError(f"{what} does not compile: {_one_line(exc)}") from None
    problem = llg.LLMatcher.validate_grammar(grammar, None, limits=_limits(llg))
    if problem:
        raise GrammarError(f"{what} does not compile: {_one_line(problem)}")
    return grammar


# What llguidance's GBNF converter does not read as llama.cpp does, rewritten before it:
# - Token references: <[id]>, or <text> (a text that tokenizes, special tokens parsed, to exactly one
#   token), either negated by a leading "!" (any one token but that one). Each is given to the
#   converter as a rule of its own that refers to itself (so the converter never makes it, or a rule
#   that uses it, a lexer terminal), whose line in the Lark text is then made the token:
#   llguidance's <[id]>, or <[^id]> negated.
# - A group under a repetition whose own last item is repeated, `("a"{0,3})*`: the converter drops
#   the parentheses and writes `"a"{0,3}*`, which Lark does not parse. Such a group becomes a rule of
#   its own (the converter keeps a rule's name; one of text alone is then a lexeme, as the
#   converter makes any such rule).
TOKEN_RULE = "muse-token-ref-{}"
GROUP_RULE = "muse-group-{}"
_TOKEN_LINE = re.compile(r"(?m)^muse_token_ref_(\d+):.*$")
_REPEATED = re.compile(r"[ \t]*[*+?{]")


def _prepare_gbnf(text: str, what: str) -> tuple[str, list[tuple[bool, str]]]:
    """(the GBNF with each token reference and each repeated group a rule's name, the references:
    negated?, the text between < >; one rule for each reference written alike)."""
    out, refs, groups, opened, i, n = [], {}, [], [], 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":   # a comment, to the end of its line
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif c in "\"[":   # a string or a character class: as written
            close, j = ('"' if c == '"' else "]"), i + 1
            while j < n and text[j] != close:
                j += 2 if text[j] == "\\" else 1
            j += 1
        elif c == "<" or (c == "!" and text.startswith("<", i + 1)):
            start = i + (c == "!")
            j = text.find(">", start)
            if j < 0:
                raise GrammarError(f"{what} does not compile: a token reference at byte {start} has no closing '>'")
            k = refs.setdefault((c == "!", text[start + 1:j]), len(refs))
            out.append(f" {TOKEN_RULE.format(k)} ")
            i = j + 1
            continue
        elif c == "(":
            opened.append(len(out))
            j = i + 1
        elif c == ")" and opened:
            start = opened.pop()
            body = "".join(out[start + 1:])
            if _REPEATED.match(text, i + 1) and body.rstrip()[-1:] in ("*", "+", "?", "}") and _one_item(body):
                groups.append(body)
                del out[start:]
                out.append(f" {GROUP_RULE.format(len(groups) - 1)}")
                i += 1
                continue
            j = i + 1
        else:
            j = i + 1
        out.append(text[i:j])
        i = j
    out += [f"\n{GROUP_RULE.format(k)} ::= ({body}\n)" for k, body in enumerate(groups)]
    out += [f"\n{TOKEN_RULE.format(k)} ::= \"\\x01\" {TOKEN_RULE.format(k)}" for k in range(len(refs))]
    return "".join(out), list(refs)


def _one_item(body: str) -> bool:
    """Whether a group's text is one item (a string, class, name, group or `.`, with its operators):
    the groups the converter unwraps."""
    items, depth, i, n = 0, 0, 0, len(body)
    while i < n:
        c = body[i]
        if c == "#":
            i = body.find("\n", i)
            i = n if i < 0 else i
            continue
        if c in "\"[":
            close, j = ('"' if c == '"' else "]"), i + 1
            while j < n and body[j] != close:
                j += 2 if body[j] == "\\" else 1
            items += depth == 0
            i = j + 1
            continue
        if c == "|" and depth == 0:
            return False
        if c == "{":
            j = body.find("}", i)
            i = n if j < 0 else j + 1
            continue
        if c == "(":
            items += depth == 0
            depth += 1
        elif c == ")":
            depth -= 1
        elif c.isalnum() or c in "-_.":
            j = i + 1
            while c != "." and j < n and (body[j].isalnum() or body[j] in "-_"):
                j += 1
            items += depth == 0
            i = j
            continue
        i += 1
    return items == 1


def _with_tokens(lark: str, refs: list[tuple[bool, str]], what: str, vocab) -> str:
    """The converter's Lark text with each reference's rule made its token."""
    ids = []
    for negated, body in refs:
        shown = f"{'!' if negated else ''}<{_one_line(body.encode('unicode_escape').decode('ascii'), 60)}>"
        if body.startswith("["):
            if not re.fullmatch(r"\[[0-9]+\]", body):
                raise GrammarError(f"{what} does not compile: token reference {shown} is not <[id]>")
            token = int(body[1:-1])
            if token > 0xFFFFFFFF:   # llama.cpp's ids are 32-bit
                raise GrammarError(f"{what} does not compile: token id {token} in {shown} is too big")
        elif not body:
            raise GrammarError(f"{what} does not compile: an empty token reference <>")
        else:
            token = vocab.token_of(f"<{body}>") if vocab is not None else 0
            if token is None:
                raise GrammarError(f"{what} does not compile: {shown} is not one token of the vocabulary")
        if vocab is not None and token >= vocab.n_vocab:
            raise GrammarError(f"{what} does not compile: token {token} ({shown}) is past the vocabulary's "
                               f"{vocab.n_vocab:,} tokens")
        ids.append((vocab.negated(token) if vocab is not None else f"<[^{token}]>") if negated else f"<[{token}]>")
    return _TOKEN_LINE.sub(lambda m: f"muse_token_ref_{m.group(1)}: {ids[int(m.group(1))]}", lark) if refs else lark


# llama-grammar.cpp's decode_utf8: a byte's top four bits -> the length of the sequence it starts (0: it
# cannot start one)
_UTF8_LENGTH = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)


def _takes_at_token(piece: bytes) -> bool:
    """Whether llama.cpp's grammar lets a token of this text (its piece, special tokens rendered) stand
    where the grammar names a token: llama-grammar.cpp's decode_utf8, from a whole character on, reads
    the text as C does (to its first NUL byte), the bytes after a sequence's first taken as they come;
    the token is refused where the text is empty, a first byte cannot start a sequence, or no
    character ends in it."""
    piece = piece.split(b"\0", 1)[0]
    pos = whole = 0
    while pos < len(piece):
        n = _UTF8_LENGTH[piece[pos] >> 4]
        if n == 0:
            return False
        pos += n
        whole += pos <= len(piece)
    return whole > 0


class Constraint:
    """One request's grammar state: the tokens allowed next, and the tokens taken so far."""

    def __init__(self, matcher, n_vocab: int, what: str):
        self._matcher, self.n_vocab, self.what = matcher, n_vocab, what

    def copy(self) -> "Constraint":
        """An independent one in the same state (another choice of one request)."""
        return Constraint(self._matcher.deep_copy(), self.n_vocab, self.what)

    def allowed(self, n_logits: int) -> mx.array:
        """(n_logits,) bool: the tokens that keep the text in the grammar's language (a logit past
        the vocabulary's never is)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        self._check()
        row = np.zeros(n_logits, dtype=bool)
        n = min(n_logits, self.n_vocab)
        row[:n] = np.unpackbits(bits, bitorder="little")[:n]
        if not row.any():
            raise GrammarError(f"{self.what} admits no text past what was generated: no token can continue it")
        return mx.array(row)

    def read(self, token: int) -> None:
        """The token taken (drawn from `allowed`'s tokens, so it is one of them)."""
        self._matcher.consume_token(int(token))
        self._check()

    @property
    def done(self) -> bool:
        """Nothing more can follow: the text is a whole sentence of the grammar, and ends it."""
        return self._matcher.is_stopped()

    def _check(self) -> None:
        if self._matcher.is_error():
            error = _one_line(self._matcher.get_error())
            if error.startswith("NoExtensionBias"):   # llguidance's word for a dead end
                raise GrammarError(f"{self.what} admits no text past what was generated: no token can continue it")
            raise GrammarError(f"{self.what}: {error}")


class LazyConstraint:
    """A grammar that applies once the text matches its trigger (Grammars.lazy): until then every
    token is allowed (`allowed` gives None); at the match, the grammar takes the tokens from the
    trigger's group on, which must start on a token's boundary (llama.cpp feeds the grammar text; a
    group that starts inside a token leaves the output unconstrained)."""

    def __init__(self, grammars: Grammars, kind: str, text: str, what: str, trigger, ends_with: bytes):
        self._grammars, self._spec, self._trigger, self._trigger_end = grammars, (kind, text, what), trigger, ends_with
        self._tokens: list[int] = []
        self._text = b""
        self._inner: Constraint | None = None
        self._off = False   # the trigger matched inside a token

    def copy(self) -> "LazyConstraint":
        out = LazyConstraint(self._grammars, *self._spec, self._trigger, self._trigger_end)
        out._tokens, out._text, out._off = list(self._tokens), self._text, self._off
        out._inner = self._inner.copy() if self._inner is not None else None
        return out

    def allowed(self, n_logits: int):
        return self._inner.allowed(n_logits) if self._inner is not None else None

    def read(self, token: int) -> None:
        if self._inner is not None:
            self._inner.read(token)
            return
        if self._off:
            return
        piece = self._grammars._texts[int(token)] if 0 <= token < len(self._grammars._texts) else b""
        self._tokens.append(int(token))
        self._text += piece
        if self._trigger_end not in piece:   # a match ends with the trigger's last character: not before it
            return
        text = self._text.decode("utf-8", "replace")
        match = self._trigger.search(text)
        if match is None:
            return
        at = len(text[:match.start(1)].encode("utf-8"))
        ends = [0]
        for t in self._tokens:
            ends.append(ends[-1] + len(self._grammars._texts[t]))
        if at not in ends:
            self._off = True
            return
        inner = self._grammars.compile(*self._spec)
        for t in self._tokens[ends.index(at):]:
            inner.read(t)
        self._inner = inner

    @property
    def done(self) -> bool:
        return self._inner is not None and self._inner.done

    @property
    def what(self) -> str:
        return self._spec[2]


def _limits(llg):
    """llguidance's bounds at their defaults, with its errors kept short (no parser state in them)."""
    return llg.LLParserLimits(verbose_errors=False)


def _one_line(exc, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def schema_text(schema) -> str:
    """A JSON schema (an object, or True for any value) as the JSON text llguidance compiles."""
    return json.dumps(schema, ensure_ascii=False, allow_nan=False)
