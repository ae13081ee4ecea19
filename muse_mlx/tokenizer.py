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
import json
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .artifact import Vocabulary
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

class MuseTokenizer:
    """Encode text to ids and ids to text the way the pinned llama.cpp does."""

    def __init__(self, vocab: Vocabulary):
        if vocab.model != "gpt2":
            raise TokenizerError(f"tokenizer model {vocab.model!r} is not supported (only byte-level BPE 'gpt2')")
        pre = vocab.pre or "default"
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(f"pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZERS))}")
        self.vocab = vocab
        ids = {tok: i for i, tok in enumerate(vocab.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
        bpe = models.BPE(vocab=ids, merges=merges, fuse_unk=False, byte_fallback=False)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        types = vocab.token_types or [1] * len(vocab.tokens)
        self.special_ids = {i for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
        self.control_ids = {i for i, t in enumerate(types)
                            if t == TOKEN_TYPE_CONTROL and vocab.tokens[i] not in ALWAYS_RENDERED}
        tok.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False)
                                for i in sorted(self.special_ids)])
        self._tok = tok
        self._u2b = {c: b for b, c in byte_to_unicode().items()}
        self.bos_id = vocab.bos_id
        self.stop_ids = {i for i in (vocab.eos_id, vocab.eot_id, vocab.eom_id) if i is not None}

    @property
    def n_vocab(self) -> int:
        return len(self.vocab.tokens)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Text -> ids, parsing special tokens; BOS first if the GGUF asks for it (or `add_bos`)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.vocab.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

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

    def streamer(self) -> "TextStreamer":
        return TextStreamer(self)

    # ---- chat --------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        template = self.vocab.chat_template
        if not template:
            raise TokenizerError("the model has no chat template (tokenizer.chat_template); use a plain prompt")
        bos = self.vocab.tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self.vocab.tokens[self.vocab.eos_id] if self.vocab.eos_id is not None else ""
        try:
            return render_chat_template(template, messages, bos_token=bos, eos_token=eos,
                                        add_generation_prompt=add_generation_prompt, **extra)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from None


class TextStreamer:
    """Turns ids into text as they arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: MuseTokenizer):
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def _raise(message):
    raise jinja2.TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def render_chat_template(template: str, messages: list[dict], **context) -> str:
    """Render a HF-style chat template (the environment transformers uses for chat templates)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, **context)
