"""The GGUF's vocabulary as a HF `tokenizers` tokenizer, and its chat template through jinja2.

The GGUF carries a GPT-2-style byte-level BPE (`tokenizer.ggml.model = "gpt2"`):
tokens, merges, token types and a pre-tokenizer name. We rebuild the same
pipeline llama.cpp runs (llama-vocab.cpp): split the text with the named
pre-tokenizer's regex, map bytes to GPT-2's printable characters, apply the
merges by rank. Control and user-defined tokens are matched as whole special
tokens in the text, as llama.cpp does with `parse_special`.
"""

from __future__ import annotations

import codecs
import ctypes
import functools
import json
import re
import threading
import traceback
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.filters
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .artifact import Vocabulary
from .cli import read_regular_file
from .dry import sequence_breakers
from .errors import TokenizerError

# Pre-tokenizer regexes, copied in meaning from llama-vocab.cpp (LLAMA_VOCAB_PRE_TYPE_*).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "gpt-2": _GPT2, "default": _GPT2, "phi-2": _GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
    "gpt-4o": _GPT4O, "llama4": _GPT4O,
}

TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4

# llama-vocab.cpp forces these to USER_DEFINED whatever the GGUF says ("quick hack for
# gpt-oss, always render these tokens"), so llama.cpp prints them; so do we.
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# What else llama-vocab.cpp (the pinned tree's load()) decides by a token's text, mirrored by
# llama_kinds below: an unset end-of-turn id is the first of EOT_TEXTS found, an unset end-of-message
# id "<|eom_id|>", an unset FIM id the first of its role's texts (each made a control token); the
# end-of-generation set is the FIM pad, repo and file-separator tokens, every token of EOG_TEXTS
# (made control) and the EOS, EOT and EOM ids; then "<|end|>" leaves it (rendered as text) where
# "<|return|>" and "<|call|>" (or "<|calls|>" and "<|flush|>") are in it, and "</s>" (made normal)
# where "<|tool_response>" or "<|plamo:eos|>" is.
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
             "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
            "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
            "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
            "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
TOKEN_TYPE_UNKNOWN = 2


def llama_kinds(vocab: Vocabulary) -> tuple[set[int], set[int], set[int]]:
    """(the special tokens: parsed in text and rendered raw, the control tokens among them: rendered
    as nothing, the end-of-generation tokens), as the pinned llama.cpp's vocabulary decides them from
    the GGUF's token types, ids and texts. Where a vocabulary holds two texts of one FIM role,
    llama.cpp takes whichever its hash map yields first; this takes the lowest id."""
    types = vocab.token_types or [1] * len(vocab.tokens)
    kind = {i: t for i, t in enumerate(types) if t in (TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
    by_text = {t: i for i, t in enumerate(vocab.tokens)}   # a repeated text: its last id, as llama.cpp's map

    def first(texts) -> int | None:
        found = [by_text[t] for t in texts if t in by_text]
        return min(found) if found else None

    def make_control(i: int) -> None:
        if kind.get(i) not in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            kind[i] = TOKEN_TYPE_CONTROL
    eot, eom, fim = vocab.eot_id, vocab.eom_id, dict(vocab.fim_ids)
    if eot is None and (eot := first(EOT_TEXTS)) is not None:
        make_control(eot)
    if eom is None and (eom := by_text.get("<|eom_id|>")) is not None:
        make_control(eom)
    for role, texts in FIM_TEXTS.items():
        if role not in fim and (found := first(texts)) is not None:
            fim[role] = found
            make_control(found)
    eog = {fim[r] for r in ("pad", "rep", "sep") if r in fim}
    for text in EOG_TEXTS:
        if text in by_text:
            eog.add(by_text[text])
            make_control(by_text[text])
    for text in ALWAYS_RENDERED:
        if text in by_text:
            kind[by_text[text]] = TOKEN_TYPE_USER_DEFINED
    eog |= {i for i in (vocab.eos_id, eot, eom) if i is not None}
    texts = {vocab.tokens[i] for i in eog}
    if "<|end|>" in texts and (("<|return|>" in texts and texts & {"<|call|>", "<|calls|>"})
                               or (texts & {"<|call|>", "<|calls|>"} and "<|flush|>" in texts)):
        end = next(i for i in eog if vocab.tokens[i] == "<|end|>")
        eog.discard(end)
        kind[end] = TOKEN_TYPE_USER_DEFINED
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
        s = next(i for i in eog if vocab.tokens[i] == "</s>")
        eog.discard(s)
        kind.pop(s, None)
    special = set(kind)
    control = {i for i, k in kind.items() if k in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)}
    return special, control, eog



@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in order,
    to code points 256, 257, ... so every byte has a visible, unambiguous character.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping

class SpecialSplitter:
    """Text cut at its special tokens (the vocabulary's control and user-defined tokens, matched
    on the raw text): at the leftmost place where one starts, the longest, then on after it, as
    tokenizers' added vocabulary matches them (aho-corasick, leftmost-longest). Done here rather
    than by `Tokenizer.add_special_tokens`, which holds the GIL for its whole build: 0.63 s for
    the bench file's 201,485 control tokens on a 2-core host, stalling the threads that load the
    weights meanwhile (ledger, 2026-12-03). Candidates are found by their first character; an
    empty token never matches. A place costs one lookup per length its first character starts,
    so `usable` bounds the lengths (a hostile vocabulary goes back to tokenizers' linear-time
    matching, with its GIL)."""

    MAX_LENGTHS = 32    # distinct lengths of the special tokens one character starts
    MAX_CHARS = 256     # the longest special token

    @classmethod
    def usable(cls, specials: dict[str, int]) -> bool:
        lengths: dict[str, set[int]] = {}
        for s in specials:
            if len(s) > cls.MAX_CHARS:
                return False
            if s:
                lengths.setdefault(s[0], set()).add(len(s))
        return all(len(ls) <= cls.MAX_LENGTHS for ls in lengths.values())

    def __init__(self, specials: dict[str, int]):
        self.ids = {s: i for s, i in specials.items() if s}
        lengths: dict[str, set[int]] = {}
        for s in self.ids:
            lengths.setdefault(s[0], set()).add(len(s))
        self.lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self.starts = re.compile("[" + "".join(re.escape(c) for c in sorted(self.lengths)) + "]") if self.ids else None

    def split(self, text: str) -> list[str | int]:
        """Pieces of text (non-empty strings) and special tokens' ids, in order."""
        out: list[str | int] = []
        at = 0
        if self.starts is not None:
            for m in self.starts.finditer(text):
                i = m.start()
                if i < at:
                    continue
                for n in self.lengths[text[i]]:
                    token = self.ids.get(text[i:i + n])
                    if token is not None:
                        if i > at:
                            out.append(text[at:i])
                        out.append(token)
                        at = i + n
                        break
        if at < len(text):
            out.append(text[at:])
        return out


class MuseTokenizer:
    """Encode text to ids and ids to text the way the pinned llama.cpp does."""

    def __init__(self, vocab: Vocabulary, chat_template: tuple[str, str] | None = None):
        """chat_template: (text, name) of a template to use instead of the GGUF's (llama.cpp's
        --chat-template-file; read_chat_template_file), compiled here so that a bad one fails now."""
        if vocab.model != "gpt2":
            raise TokenizerError(f"tokenizer model {vocab.model!r} is not supported (only byte-level BPE 'gpt2')")
        pre = vocab.pre or "default"
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(f"pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZERS))}")
        self.vocab = vocab
        ids, merges = validate_vocabulary(vocab)
        self.special_ids, self.control_ids, eog = llama_kinds(vocab)
        try:
            bpe = models.BPE(vocab=ids, merges=merges, fuse_unk=False, byte_fallback=False)
            tok = Tokenizer(bpe)
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
            tok.decoder = decoders.ByteLevel()
            specials = {vocab.tokens[i]: i for i in self.special_ids}
            self._specials = SpecialSplitter(specials) if SpecialSplitter.usable(specials) else None
            if self._specials is None:
                tok.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False)
                                        for i in sorted(self.special_ids)])
        except BaseException as exc:  # a backstop: tokenizers' Rust panics are BaseExceptions
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise TokenizerError(f"the vocabulary cannot be built into a tokenizer: {_one_line(exc)}") from None
        self._tok = tok
        self._template = None  # compiled on first use
        self.chat_template_file = chat_template
        if chat_template is not None:
            self._template = compile_chat_template(*chat_template)
        self._u2b = {c: b for b, c in byte_to_unicode().items()}
        self.bos_id = vocab.bos_id
        self.stop_ids = eog   # llama.cpp's end-of-generation tokens (llama_kinds)

    @property
    def n_vocab(self) -> int:
        return len(self.vocab.tokens)

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Text -> ids, parsing special tokens (with `parse_special`, where the vocabulary's special
        tokens allow it to be turned off: SpecialSplitter.usable); BOS first if the GGUF asks for it
        (or `add_bos`).

        Text that is not Unicode (a lone surrogate: an undecodable byte of argv, a JSON escape) is a
        TokenizerError. The pieces go through tokenizers' `encode_batch`, which releases the GIL while
        it works (`encode` holds it: ~1 s a MB of text with every other Python thread stopped), so
        a server tokenizing a long prompt on a worker thread keeps serving."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"the text is not Unicode: a lone surrogate ({ord(text[exc.start]):#06x}) at "
                                 f"character {exc.start:,}") from None
        split = self._specials is not None and parse_special
        pieces = self._specials.split(text) if split else [text]   # _specials None: tokenizers matches them
        texts = [p for p in pieces if not isinstance(p, int)]
        encoded = iter(self._tok.encode_batch(texts, add_special_tokens=False) if texts else ())
        ids = []
        for piece in pieces:
            ids += [piece] if isinstance(piece, int) else next(encoded).ids
        if (self.vocab.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token's text takes (its stored form, never shorter than the bytes
        it renders as or is parsed from): a text of n bytes is at least n / this many tokens."""
        return max((len(t.encode("utf-8", "surrogatepass")) for t in self.vocab.tokens), default=1) or 1

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token renders as; control tokens render as nothing (llama.cpp, special=false)."""
        if token_id in self.control_ids:
            return b""
        text = self.vocab.tokens[token_id]
        if token_id in self.special_ids:
            return text.encode("utf-8")
        try:
            return bytes(self._u2b[c] for c in text)
        except KeyError:
            return text.encode("utf-8")

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def dry_breakers(self, texts: tuple[str, ...]) -> dict[int, tuple[tuple[int, ...], ...]]:
        """DRY's sequence breakers as tokens: each text's (dry.sequence_breakers) put together."""
        out: dict[int, tuple[tuple[int, ...], ...]] = {}
        for text in texts:
            for token, tails in self._dry_breaker(text).items():
                out[token] = out.get(token, ()) + tuple(t for t in tails if t not in out.get(token, ()))
        return out

    @functools.lru_cache(maxsize=64)
    def _dry_breaker(self, text: str) -> dict[int, tuple[tuple[int, ...], ...]]:
        """One breaker's tokens, over every token's text as llama.cpp's detokenize(special=true) gives
        it: a text's first use reads the whole vocabulary."""
        return sequence_breakers(self._pieces, lambda rest: self.encode(rest, add_bos=False, parse_special=False),
                                 (text,))

    @functools.cached_property
    def _pieces(self) -> list[bytes]:
        return [t.encode("utf-8") if i in self.control_ids else self.token_bytes(i)
                for i, t in enumerate(self.vocab.tokens)]

    def streamer(self, shown=frozenset()) -> "TextStreamer":
        """shown: control tokens rendered as their text here (llama-server's preserved tokens of a
        chat format, which its parser reads)."""
        return TextStreamer(self, shown)

    def token_ids(self, texts) -> frozenset:
        """The ids of the tokens whose text is one of `texts`."""
        wanted = set(texts)
        return frozenset(i for i, t in enumerate(self.vocab.tokens) if t in wanted)

    # ---- chat --------------------------------------------------------------------------
    @property
    def chat_template(self) -> str:
        """The template's text in use: the one given in place of the GGUF's, else the GGUF's ('' if none)."""
        return self.chat_template_file[0] if self.chat_template_file else (self.vocab.chat_template or "")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render the GGUF's chat template (compiled once, on first use) in a bounded sandbox; `extra`:
        the template's own variables (llama.cpp's chat_template_kwargs), which may also replace
        bos_token and eos_token, as llama.cpp's may.

        Any failure -- invalid UTF-8, a template that does not compile, one that fails,
        recurses, runs too long or writes too much when rendered -- is one `TokenizerError`.
        """
        if self._template is None:
            if getattr(self.vocab, "chat_template_error", None):
                raise TokenizerError(f"{TEMPLATE_NAME} cannot be read: {self.vocab.chat_template_error}")
            if not self.vocab.chat_template:
                raise TokenizerError(f"the model has no chat template ({TEMPLATE_NAME}); use a plain prompt")
            self._template = compile_chat_template(self.vocab.chat_template)
        bos = self.vocab.tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self.vocab.tokens[self.vocab.eos_id] if self.vocab.eos_id is not None else ""
        context = dict(bos_token=bos, eos_token=eos, add_generation_prompt=add_generation_prompt)
        context.update(extra)   # the template's own variables, over the defaults (as llama.cpp's extra context)
        return _render(self._template, dict(context, messages=messages))


class TextStreamer:
    """Turns ids into text as they arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: MuseTokenizer, shown=frozenset()):
        self.tokenizer, self.shown = tokenizer, shown
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id in self.shown:
            return self._decoder.decode(self.tokenizer.vocab.tokens[token_id].encode("utf-8", "surrogatepass"))
        return self._decoder.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


# ---- the vocabulary as untrusted input ---------------------------------------------------


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def validate_vocabulary(vocab: Vocabulary) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Check what tokenizers would otherwise panic or raise on; return its vocab map and merge pairs.

    Tokens: unique (a duplicate makes the Rust side panic). Merges: each exactly two
    space-separated non-empty parts, both tokens of the vocabulary, and their concatenation
    one too (tokenizers' BPE requires all three). Token strings are valid UTF-8 already
    (artifact.py decodes them strictly).
    """
    ids: dict[str, int] = {}
    for i, token in enumerate(vocab.tokens):
        first = ids.setdefault(token, i)
        if first != i:
            raise TokenizerError(f"tokenizer.ggml.tokens: token {i} {_show(token)} repeats token {first}; "
                                 "token strings must be unique")
    pairs = []
    for n, merge in enumerate(vocab.merges):
        parts = merge.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise TokenizerError(f"tokenizer.ggml.merges: merge {n} {_show(merge)} is not two tokens "
                                 "separated by one space")
        for part in (parts[0], parts[1], parts[0] + parts[1]):
            if part not in ids:
                raise TokenizerError(f"tokenizer.ggml.merges: merge {n} {_show(merge)} names {_show(part)}, "
                                     "which is not in the vocabulary")
        pairs.append((parts[0], parts[1]))
    return ids, pairs


def _show(s: str, limit: int = 40) -> str:
    return repr(s if len(s) <= limit else s[:limit] + "...")


# ---- the chat template as untrusted input ----------------------------------------------
#
# The template comes from the file, so it runs in jinja2's immutable sandbox (no attribute
# or call reaches Python internals) with bounds on what it may cost:
#   - size: a template over 1 MiB is refused (real ones are kilobytes);
#   - output: at most TEMPLATE_OUTPUT_BYTES plus four times the messages' own size; strings
#     and lists built by *, + and namespace assignment, and width/indent arguments, are held
#     to the same bound before they are built;
#   - depth: at most TEMPLATE_MAX_DEPTH nested calls (macros calling themselves), well inside
#     Python's own recursion limit;
#   - time: TEMPLATE_SECONDS of wall time for compiling or rendering, enforced by a watchdog
#     that raises in the rendering thread (so loops that call nothing are bounded too).
# Whatever goes wrong becomes one TokenizerError naming the template and, where known, its line.

TEMPLATE_NAME = "chat template (tokenizer.chat_template)"
TEMPLATE_MAX_BYTES = 1 << 20
TEMPLATE_OUTPUT_BYTES = 1 << 20
TEMPLATE_MAX_DEPTH = 64
TEMPLATE_SECONDS = 5.0
_HUGE_FORMAT = re.compile(r"\d{7,}")  # a width or precision of a million or more


class _TemplateLimit(Exception):
    """A template ran past one of the bounds above."""


class _TemplateTimeout(BaseException):
    """Raised asynchronously in the rendering thread by the watchdog (BaseException: it must
    not be swallowed by a template's own error handling)."""


def _raise(message):
    raise jinja2.TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


class _Bounds(threading.local):
    limit = TEMPLATE_OUTPUT_BYTES
    depth = 0


_bounds = _Bounds()


def _check_size(n: int, what: str) -> None:
    if n > _bounds.limit:
        raise _TemplateLimit(f"{what} of {n:,} characters or items exceeds the limit of {_bounds.limit:,}")


def _check_args(args, kwargs, what: str) -> None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, bool):
            continue
        if isinstance(a, int) and abs(a) > _bounds.limit:
            raise _TemplateLimit(f"{what} with the argument {a:,} (more than {_bounds.limit:,})")
        _check_size(_size(a), f"{what} with an argument")


def _bounded_filter(f):
    """Wrap a jinja2 filter or global: refuse huge arguments, check the result's size."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        _check_args(args, kwargs, f"{getattr(f, '__name__', 'filter')}()")
        if f is jinja2.filters.do_format \
                and any(isinstance(a, str) and _HUGE_FORMAT.search(a) for a in args[:2]):
            raise _TemplateLimit("format() with a width or precision of a million or more")
        result = f(*args, **kwargs)
        _check_size(_size(result), f"{getattr(f, '__name__', 'filter')}() result")
        return result

    return wrapper


class _BoundedNamespace(Namespace):
    def __setitem__(self, name, value):
        _check_size(_size(value), f"namespace value {name!r}")
        super().__setitem__(name, value)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, op, left, right):
        if op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1 and abs(left).bit_length() * right > 8 * _bounds.limit:
            raise _TemplateLimit(f"{left} ** {right} is too large")
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and _size(seq):
                    _check_size(_size(seq) * max(n, 0), "a repeated string or list")
            if isinstance(left, int) and isinstance(right, int):
                if abs(left).bit_length() + abs(right).bit_length() > 8 * _bounds.limit:
                    raise _TemplateLimit("an integer product too large")
        if op == "+" and _size(left) and _size(right):
            _check_size(_size(left) + _size(right), "a concatenation")
        if op == "%" and isinstance(left, str):
            if _HUGE_FORMAT.search(left) or "*" in left:
                raise _TemplateLimit("%-formatting with a width or precision of a million or more, or '*'")
        return super().call_binop(context, op, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        _check_args(args, kwargs, f"{getattr(__obj, '__name__', 'a call')}()")
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        if getattr(target, "__name__", None) in ("format", "format_map") and isinstance(
                getattr(target, "__self__", None), str) and _HUGE_FORMAT.search(target.__self__):
            raise _TemplateLimit("str.format with a width or precision of a million or more")
        if _bounds.depth >= TEMPLATE_MAX_DEPTH:
            raise _TemplateLimit(f"calls nested more than {TEMPLATE_MAX_DEPTH} deep (runaway recursion?)")
        _bounds.depth += 1
        try:
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            _bounds.depth -= 1
        _check_size(_size(result), f"{getattr(__obj, '__name__', 'a call')}() result")
        return result


def _environment() -> _BoundedEnvironment:
    """The environment transformers uses for chat templates, with the bounds above."""
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(f)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _BoundedNamespace
    return env


_SET_ASYNC_EXC = ctypes.pythonapi.PyThreadState_SetAsyncExc


@contextmanager
def _watchdog(seconds: float):
    """Raise _TemplateTimeout in this thread if the block runs longer than `seconds`."""
    tid = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire():
        with lock:
            if not state["done"]:
                state["fired"] = True
                _SET_ASYNC_EXC(ctypes.c_ulong(tid), ctypes.py_object(_TemplateTimeout))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            state["done"] = True
        timer.cancel()
        if state["fired"]:
            _SET_ASYNC_EXC(ctypes.c_ulong(tid), None)  # clear it if it is still pending


def _template_line(exc: BaseException) -> str:
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<template>"]
    return f" at line {lines[-1]}" if lines else ""


def _template_error(stage: str, exc: BaseException, name: str = TEMPLATE_NAME) -> TokenizerError:
    if isinstance(exc, _TemplateTimeout):
        return TokenizerError(f"{name}: {stage} took longer than {TEMPLATE_SECONDS:g} s; stopped")
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return TokenizerError(f"{name} does not compile: line {exc.lineno}: {_one_line(exc.message or exc)}")
    kind = "" if isinstance(exc, (_TemplateLimit, jinja2.TemplateError)) else f"{type(exc).__name__}: "
    return TokenizerError(f"{name}: {stage} failed{_template_line(exc)}: {kind}{_one_line(exc)}")


def read_chat_template_file(path) -> tuple[str, str]:
    """A chat template from a file, for MuseTokenizer's chat_template: (its text, the name errors
    give it). A file that cannot be read, is not UTF-8 or is too long is one TokenizerError."""
    name = f"chat template file {str(path)!r}"
    try:
        raw = read_regular_file(path, TEMPLATE_MAX_BYTES)
    except OSError as exc:
        raise TokenizerError(f"{name} cannot be read: {exc.strerror or exc}") from None
    if len(raw) > TEMPLATE_MAX_BYTES:
        raise TokenizerError(f"{name} is longer than the {TEMPLATE_MAX_BYTES:,} bytes accepted")
    try:
        return raw.decode("utf-8"), name
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{name} is not UTF-8: byte {exc.start:,} ({raw[exc.start]:#04x})") from None


def compile_chat_template(template: str, name: str = TEMPLATE_NAME) -> jinja2.Template:
    """Compile an untrusted template; any failure is one TokenizerError naming it (`name`)."""
    if len(template) > TEMPLATE_MAX_BYTES:
        raise TokenizerError(f"{name} is {len(template):,} characters long; "
                             f"at most {TEMPLATE_MAX_BYTES:,} are accepted")
    try:
        with _watchdog(TEMPLATE_SECONDS):
            template = _environment().from_string(template)
    except (Exception, _TemplateTimeout) as exc:  # RecursionError, MemoryError and the like included
        raise _template_error("compiling", exc, name) from None
    template.muse_name = name   # for _render's messages
    return template


def _render(template: jinja2.Template, context: dict) -> str:
    """Render with the bounds above: output size, call depth, time."""
    try:
        inputs = len(json.dumps(context.get("messages"), default=str, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        inputs = 0
    saved = (_bounds.limit, _bounds.depth)
    _bounds.limit, _bounds.depth = TEMPLATE_OUTPUT_BYTES + 4 * inputs, 0
    out, total = [], 0
    try:
        with _watchdog(TEMPLATE_SECONDS):
            for chunk in template.generate(**context):
                total += len(chunk)
                if total > _bounds.limit:
                    raise _TemplateLimit(f"the output passed {_bounds.limit:,} characters")
                out.append(chunk)
    except (Exception, _TemplateTimeout) as exc:
        raise _template_error("rendering", exc, getattr(template, "muse_name", TEMPLATE_NAME)) from None
    finally:
        _bounds.limit, _bounds.depth = saved
    return "".join(out)


def render_chat_template(template: str, messages: list[dict], **context) -> str:
    """Render a HF-style chat template (the environment transformers uses for chat templates),
    bounded as described above; any failure is one TokenizerError."""
    return _render(compile_chat_template(template), dict(messages=messages, **context))
