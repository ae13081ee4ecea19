"""`python -m muse_mlx.server`: an OpenAI-compatible HTTP server over 1..4 slots.

    python -m muse_mlx.server --model X.gguf --parallel 4 --ctx-size 32768 [--host 127.0.0.1 --port 8080]
                              [--api-key KEY] [--queue 16] [--prompt-cache [DIR]] [--slot-save-path DIR]

Routes: POST /v1/completions and /v1/chat/completions (streaming over SSE or not), llama-server's
POST /completion (its fields and answer), /tokenize, /detokenize, /apply-template and GET /props, GET /v1/models,
GET /health, GET /slots, POST /slots/{id}?action=save|restore (body {"filename": NAME}, a kvpack
under --slot-save-path). Built on Starlette + uvicorn + sse-starlette; the engine side is
muse_mlx/slots.py. Errors are OpenAI-style bodies: 400 for a request that is wrong (naming the
field), 401 without the API key, 404, 413 for a body past its limit, 503 with Retry-After when the
queue is full, 507 (else 500) when the disk refuses a pack. Answers carry llama-server's `timings`.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import math
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from . import __version__, chat_format, cli
from .cli import Parser
from .config import KernelConfig
from .errors import MuseError
from .grammar import GrammarError, Grammars, schema_text
from .sampling import (DEFAULT_SAMPLERS, SamplerSettings, add_samplers_flags, breakers_of_flags, samplers_flags,
                       samplers_of)
from .slots import QueueFull, Request, Scheduler

MAX_STOP_STRINGS, MAX_TOP_LOGPROBS = 16, 20
MAX_CHOICES = 8   # a request's `n`: each choice takes a slot (or waits for one) as a request of its own
# A stop string's characters at most: the engine thread matches every stop string against the text
# each token (slots.StopMatcher), so its length bounds what one request can cost every slot.
MAX_STOP_CHARS = 4096


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


JSON_MAX_BYTES = 64 * 2**20   # a request's JSON body: a whole context of token ids is ~1 MB


async def read_body(request, limit: int, what: str = "the request's body") -> bytes:
    """The body, refused with 413 past `limit` bytes (by its Content-Length before reading, else as
    it arrives): a client cannot make the server hold more than that."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"{what} is {int(declared):,} bytes, more than the {limit:,} this server takes", None, 413)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BadRequest(f"{what} is more than the {limit:,} bytes this server takes", None, 413)
        parts.append(part)
    return b"".join(parts)


def _reject_constant(name):
    raise BadRequest(f"{name} is not a JSON number")


MAX_BODY_NESTING = 128   # a request's JSON nests at most this deep (a schema of any real use nests far less)


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8") from None
    except ValueError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(f"the body nests more than {MAX_BODY_NESTING} levels deep") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    if chat_format.nesting(data, MAX_BODY_NESTING) > MAX_BODY_NESTING:
        raise BadRequest(f"the body nests more than {MAX_BODY_NESTING} levels deep")
    return data


def _number(body, name, default, lo=None, hi=None, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"'{name}' must be a finite number", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        raise BadRequest(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _boolean(body, name, default=False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be a boolean", name)
    return v


def _integer(body, name, default, lo=None, hi=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{name}' must be an integer", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


# llama.cpp's llama_vocab_type, by the GGUF's tokenizer.ggml.model
VOCAB_TYPES = {"no_vocab": 0, "llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}
# llama-server's sampling flags: the defaults of a request's fields (flag, field, type)
SAMPLING_FLAGS = (("--temp", "temperature", float), ("--top-k", "top_k", int), ("--top-p", "top_p", float),
                  ("--min-p", "min_p", float), ("--typical", "typical_p", float),
                  ("--top-n-sigma", "top_n_sigma", float), ("--xtc-probability", "xtc_probability", float),
                  ("--xtc-threshold", "xtc_threshold", float), ("--dynatemp-range", "dynatemp_range", float),
                  ("--dynatemp-exp", "dynatemp_exponent", float), ("--seed", "seed", int), ("--repeat-penalty", "repeat_penalty", float),
                  ("--repeat-last-n", "repeat_last_n", int), ("--presence-penalty", "presence_penalty", float),
                  ("--frequency-penalty", "frequency_penalty", float), ("--dry-multiplier", "dry_multiplier", float),
                  ("--dry-base", "dry_base", float), ("--dry-allowed-length", "dry_allowed_length", int),
                  ("--dry-penalty-last-n", "dry_penalty_last_n", int), ("--mirostat", "mirostat", int),
                  ("--mirostat-lr", "mirostat_eta", float), ("--mirostat-ent", "mirostat_tau", float),
                  ("--adaptive-target", "adaptive_target", float), ("--adaptive-decay", "adaptive_decay", float),
                  ("--min-keep", "min_keep", int))
MAX_DRY_BREAKERS = 16   # texts of one request's dry_sequence_breakers (each new one: a pass over the vocabulary, ~0.15 s)


def with_defaults(body: dict, defaults: dict) -> dict:
    """The body with the server's defaults (its sampling flags) where it gives a field no value."""
    if not defaults:
        return body
    return {**body, **{k: v for k, v in defaults.items() if body.get(k) is None}}


def sampling_of(body: dict, n_vocab: int) -> SamplerSettings:
    dry_base = _number(body, "dry_base", 1.75, hi=1e6)
    return SamplerSettings(temp=_number(body, "temperature", 1.0, 0.0, 100.0),
                           top_k=_integer(body, "top_k", 0, 0, 1 << 30),
                           top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                           min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
                           typical_p=_number(body, "typical_p", 1.0, 0.0, 1.0),
                           top_n_sigma=_number(body, "top_n_sigma", -1.0),
                           xtc_probability=_number(body, "xtc_probability", 0.0, 0.0, 1.0),
                           xtc_threshold=_number(body, "xtc_threshold", 0.1, 0.0, 1.0),
                           dynatemp_range=_number(body, "dynatemp_range", 0.0, 0.0, 100.0),
                           dynatemp_exponent=_number(body, "dynatemp_exponent", 1.0, 0.0, 100.0),
                           seed=_integer(body, "seed", 0),
                           presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                           frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                           repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.0, 100.0, lo_open=True),
                           repeat_last_n=_integer(body, "repeat_last_n", 64, 0, 1 << 20),
                           logit_bias=logit_bias_of(body, n_vocab),
                           dry_multiplier=_number(body, "dry_multiplier", 0.0, -1e6, 1e6),
                           dry_base=dry_base if dry_base >= 1.0 else 1.75,   # under 1: the default, as llama-server's
                           dry_allowed_length=_integer(body, "dry_allowed_length", 2, 0, (1 << 31) - 1),
                           dry_penalty_last_n=_integer(body, "dry_penalty_last_n", 64, 0, (1 << 31) - 1),
                           dry_sequence_breakers=dry_breakers_of(body),
                           mirostat=_integer(body, "mirostat", 0, 0, 2),
                           mirostat_tau=_number(body, "mirostat_tau", 5.0, -1e6, 1e6),
                           mirostat_eta=_number(body, "mirostat_eta", 0.1, -1e6, 1e6),
                           samplers=samplers_field(body),
                           adaptive_target=_number(body, "adaptive_target", -1.0, -1e6, 1e6),
                           adaptive_decay=_number(body, "adaptive_decay", 0.9, -1e6, 1e6),
                           min_keep=_integer(body, "min_keep", 0, 0, 1 << 30))


def samplers_field(body: dict) -> tuple[str, ...]:
    """llama-server's `samplers`: the chain's order, as sampler names or a string of their characters."""
    v = body.get("samplers")
    if v is None:
        return DEFAULT_SAMPLERS
    if isinstance(v, tuple):   # the server's own --samplers / --sampling-seq, already read
        return v
    if not (isinstance(v, str) and len(v) <= 64 or isinstance(v, list) and len(v) <= 64):
        raise BadRequest("'samplers' must be a list of at most 64 sampler names or a string of their characters",
                         "samplers")
    try:
        return samplers_of(v)
    except ValueError as exc:
        raise BadRequest(f"'samplers': {exc}", "samplers") from None


def dry_breakers_of(body: dict) -> tuple[str, ...]:
    """llama-server's dry_sequence_breakers: a non-empty list of non-empty texts (absent: the defaults)."""
    v = body.get("dry_sequence_breakers")
    if v is None:
        return SamplerSettings.dry_sequence_breakers
    if isinstance(v, tuple):   # the server's own --dry-sequence-breaker (none, with 'none')
        return v
    if (not isinstance(v, list) or not 0 < len(v) <= MAX_DRY_BREAKERS
            or not all(isinstance(b, str) and 0 < len(b) <= 1000 for b in v)):
        raise BadRequest(f"'dry_sequence_breakers' must be a list of 1 to {MAX_DRY_BREAKERS} non-empty texts "
                         f"of at most 1,000 characters", "dry_sequence_breakers")
    return tuple(v)


MAX_LOGIT_BIAS = 1024   # entries of one request's logit_bias (OpenAI allows 300)


def logit_bias_of(body: dict, n_vocab: int) -> tuple:
    """A request's logit bias -> ((id, bias), ...), ids in order: OpenAI's object ({"token id": bias
    in [-100, 100]}) or llama-server's list ([[token id, bias], ...], the biases of a repeated id
    added as llama.cpp applies each pair; its `false` is minus infinity: the token is never picked)."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if isinstance(bias, list):
        return _logit_bias_pairs(bias, n_vocab)
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids, or a list of "
                         f"[token id, bias] pairs", "logit_bias")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9 and int(key) < n_vocab):
            raise BadRequest(f"'logit_bias': {key[:40]!r} is not a token id in 0..{n_vocab - 1}", "logit_bias")
        out.append((int(key), _number({"logit_bias": value}, "logit_bias", 0.0, -100.0, 100.0)))
    return tuple(sorted(out))


def _logit_bias_pairs(pairs: list, n_vocab: int) -> tuple:
    if len(pairs) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' must hold at most {MAX_LOGIT_BIAS} pairs", "logit_bias")
    out: dict[int, float] = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int)
                and not isinstance(pair[0], bool)):
            raise BadRequest("'logit_bias' as a list must hold [token id, bias] pairs", "logit_bias")
        if not 0 <= pair[0] < n_vocab:
            raise BadRequest(f"'logit_bias': {pair[0]} is not a token id in 0..{n_vocab - 1}", "logit_bias")
        bias = -math.inf if pair[1] is False else _number({"logit_bias": pair[1]}, "logit_bias", 0.0, -100.0, 100.0)
        out[pair[0]] = out.get(pair[0], 0.0) + bias
    if any(not -100.0 <= b <= 100.0 for b in out.values() if b != -math.inf):
        raise BadRequest("'logit_bias': a token's biases add up to more than 100 in size", "logit_bias")
    return tuple(sorted(out.items()))


def _error_kind(ev: dict) -> tuple[int, str]:
    """An engine event's error as (HTTP status, OpenAI error type): the request's own (its grammar's
    dead end) is a 400, anything else the server's 500."""
    return (400, "invalid_request_error") if ev.get("invalid") else (500, "server_error")


def _prompt_events(evs: list[dict]) -> list[dict]:
    """The prompt's tokens as token events (what _completion_lps reads) from its prompt_logprobs events."""
    return [{"token": t, "logprob": lp, "top_logprobs": top}
            for e in evs if "prompt_logprobs" in e for t, lp, top in e["prompt_logprobs"]]


def _usage(lasts: list[dict]) -> dict:
    """A request's usage over its choices: the prompt counted once, as OpenAI counts it."""
    prompt, cached = lasts[0]["usage"]["prompt_tokens"], lasts[0]["usage"]["prompt_tokens_details"]["cached_tokens"]
    completion = sum(last["usage"]["completion_tokens"] for last in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def generation_settings(req: Request, stream: bool) -> dict:
    """llama-server's `generation_settings` of an answer: the settings this request ran with."""
    from dataclasses import asdict

    out = asdict(req.sampling)
    out["temperature"] = out.pop("temp")
    out["logit_bias"] = [[t, b if b != -math.inf else False] for t, b in req.sampling.logit_bias]
    return {**out, "n_predict": req.max_tokens, "max_tokens": req.max_tokens, "ignore_eos": req.ignore_eos,
            "stop": list(req.stop_strings), "n_probs": req.logprobs or 0, "stream": stream}


# Request fields of the OpenAI and llama-server APIs this server does not serve, each with the values
# that ask for nothing (what a client sends by default): any other value is refused by name rather
# than ignored, so that no one reads unconstrained text as what they asked for.
UNSERVED = {
    "functions": ([],), "best_of": (1,), "suffix": ("",),
    # llama-server's LoRA adapters, its grammar triggered from the client's own triggers, its
    # indentation and reasoning budget
    "lora": ([],), "grammar_lazy": (False,), "grammar_triggers": ([],),
    "preserved_tokens": ([],), "n_indent": (0,), "reasoning_budget_tokens": (-1,),
}
# What a chat request gives its template itself: `chat_template_kwargs` may not set these.
TEMPLATE_INPUTS = frozenset({"messages", "add_generation_prompt", "tools"})


def refuse_unserved(body: dict) -> None:
    for name, neutral in UNSERVED.items():
        v = body.get(name)
        if v is not None and not any(type(v) is type(n) and v == n for n in neutral):
            raise BadRequest(f"'{name}' is not served here: leave it out (or send {neutral[0]!r})", name)


def grammar_request(body: dict) -> tuple[str, str, str] | None:
    """The grammar a request asks its output to follow, as (kind, text, field) for grammar.Grammars:
    OpenAI's `response_format` (json_object: a JSON object; json_schema: its `schema`; text: none),
    llama-server's `json_schema` (a schema; {} any JSON value) or `grammar` (GBNF; "" none). At most
    one of them."""
    asked = []
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            schema = rf.get("schema", {"type": "object"})
            asked.append(("json_schema", schema, "response_format"))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise BadRequest("'response_format' of type json_schema needs 'json_schema': {\"schema\": ...}",
                                 "response_format")
            asked.append(("json_schema", spec["schema"], "response_format"))
        elif kind != "text":
            raise BadRequest("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": ...}}", "response_format")
    if body.get("json_schema") is not None:
        asked.append(("json_schema", body["json_schema"], "json_schema"))
    grammar = body.get("grammar")
    if grammar is not None:
        if not isinstance(grammar, str):
            raise BadRequest("'grammar' must be a string (a GBNF grammar)", "grammar")
        if grammar:
            asked.append(("gbnf", grammar, "grammar"))
    if len(asked) > 1:
        raise BadRequest(f"'{asked[0][2]}' and '{asked[1][2]}' both constrain the output: send one", asked[1][2])
    if not asked:
        return None
    kind, spec, field = asked[0]
    if kind == "json_schema":
        if not isinstance(spec, (dict, bool)):
            raise BadRequest(f"'{field}': a JSON schema must be an object (or a boolean)", field)
        spec = schema_text(spec)
    return kind, spec, field


def message_text(content, joiner: str = "\n") -> str:
    """A chat message's content: a string, or OpenAI's list of text parts, joined by newlines as
    llama.cpp joins them for a template that takes strings (common/chat.cpp; `joiner`: a continued
    message's parts are joined by its render_content's "\n\n"). Other parts (images, audio) are not served."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(p, dict) for p in content):
        kinds = {p.get("type") for p in content}
        if kinds == {"text"} and all(isinstance(p.get("text"), str) for p in content):
            return joiner.join(p["text"] for p in content)
        other = sorted(k for k in kinds - {"text"} if isinstance(k, str))
        if other:
            raise BadRequest(f"a message's {other[0][:40]!r} content part is not served here (text only)", "messages")
    raise BadRequest("a message's 'content' must be a string or a list of {\"type\": \"text\", \"text\": ...} "
                     "parts", "messages")


def stops_of(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise BadRequest(f"a stop string may have at most {MAX_STOP_CHARS:,} characters, got {longest:,}", "stop")
    return stops


# Blobs a sender put (PUT /kv/blobs) wait in <slot-save-path>/.incoming until a pack takes them
# (POST /kv/packs copies them in and removes them there); one no pack took within this many seconds
# of its arrival is removed (a sender that stopped between its blobs and its manifest).
INCOMING_TTL_S = 3600.0


class App:
    """The HTTP side: validation, the request's event queue, the OpenAI response shapes."""

    def __init__(self, scheduler: Scheduler, tokenizer, model_name: str, api_keys, model_id: dict,
                 slot_save_path: Path | None, incoming_ttl_s: float = INCOMING_TTL_S, batch_invariant: bool = False,
                 metrics: bool = False, reasoning_format: str = "auto"):
        self.scheduler, self.tokenizer, self.model_name = scheduler, tokenizer, model_name
        # the keys a request may carry (none: no key asked for); model_name's other names (--alias)
        self.api_keys, self.model_id, self.slot_save_path = tuple(api_keys or ()), model_id, slot_save_path
        self.aliases: tuple[str, ...] = ()
        self.incoming_ttl_s, self.batch_invariant, self.metrics = incoming_ttl_s, batch_invariant, metrics
        self._grammars: Grammars | None = None   # llguidance's token table, made at the first grammar
        self._grammars_lock = threading.Lock()
        self.reasoning_format = reasoning_format   # llama-server's --reasoning-format: a request's default
        self.prefill_assistant = True   # a last message from the assistant is continued (llama-server's default)
        self.defaults: dict = {}   # request fields' defaults from the command line (SAMPLING_FLAGS, -n)
        # the chat template's answers are read (reasoning, content, tool calls) where it is muse-glimmer's
        self.reads_answers = chat_format.is_muse_glimmer(tokenizer.chat_template)
        self._shown = tokenizer.token_ids(chat_format.PRESERVED) & tokenizer.control_ids   # a stop token's too (ignore_eos)

    @property
    def blob_max_bytes(self) -> int:
        """The largest blob a pack of this model can hold (kvpack's: a plane chunk of CHUNK_ROWS
        positions, a ring group of RING_GROUP layers at the full window, the last logits; float32,
        the widest encoding), plus room for its safetensors header: PUT /kv/blobs takes no more."""
        from . import kvpack

        g = self.scheduler.model.geometry
        row = 2 * g.n_head_kv * g.head_dim * 4
        largest = max(kvpack.CHUNK_ROWS * g.n_full * row, kvpack.RING_GROUP * g.sliding_window * row, g.n_vocab * 4)
        return largest + 2**20

    # ---- routes ----

    def starlette(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.middleware import Middleware
        from starlette.routing import Route

        routes = [Route("/health", self.health, methods=["GET"]), Route("/v1/models", self.models, methods=["GET"]),
                  Route("/props", self.props, methods=["GET"]), Route("/metrics", self.metrics_text, methods=["GET"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/apply-template", self.apply_template, methods=["POST"]),
                  Route("/slots", self.slots, methods=["GET"]), Route("/slots/{id}", self.slot_action, methods=["POST"]),
                  Route("/kv/blobs", self.kv_blobs, methods=["GET"]),
                  Route("/kv/blobs/{name}", self.kv_put_blob, methods=["PUT"]),
                  Route("/kv/packs/{filename}", self.kv_put_pack, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/completion", self.llama_completion, methods=["POST"]),
                  Route("/completions", self.llama_completion, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/responses", self.responses, methods=["POST"]),
                  Route("/v1/messages", self.anthropic_messages, methods=["POST"]),
                  Route("/v1/messages/count_tokens", self.anthropic_count_tokens, methods=["POST"]),
                  Route("/responses", self.responses, methods=["POST"])]

        async def http_error(request, exc):
            return self.error(exc.detail, status=exc.status_code, kind="not_found_error" if exc.status_code == 404
                              else "invalid_request_error")
        return Starlette(routes=routes, exception_handlers={HTTPException: http_error},
                         middleware=[Middleware(_AuthMiddleware, app_state=self)])

    def disk_error(self, exc: OSError, what: str):
        """The server's disk refused a pack's or blob's bytes: not the request's fault, so 507
        (Insufficient Storage) when it is full, else 500; the OpenAI-style body names what and why."""
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        return self.error(f"{what}: {exc.strerror or exc}", 507 if full else 500, "filename", "server_error")

    @staticmethod
    def error(message: str, status: int = 400, param: str | None = None, kind: str = "invalid_request_error",
              headers: dict | None = None):
        from starlette.responses import JSONResponse

        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                            status_code=status, headers=headers)

    async def metrics_text(self, request):
        """llama-server's /metrics (with --metrics): the engine's counters in Prometheus's text format
        (muse_mlx/metrics.py says what each holds)."""
        from starlette.responses import Response

        if not self.metrics:
            return self.error("this server does not serve /metrics: start it with --metrics", 501, None,
                              "not_supported_error")
        with self.scheduler.wake:
            processing, deferred = self.scheduler.busy_slots(), len(self.scheduler.waiting)
        return Response(self.scheduler.metrics.exposition(processing, deferred),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(self, request):
        from starlette.responses import JSONResponse

        states = [s["state"] for s in self.scheduler.describe()]
        return JSONResponse({"status": "ok", "slots_idle": states.count("idle"),
                             "slots_processing": len(states) - states.count("idle")})

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "aliases": list(self.aliases),
                                                         "object": "model", "created": 0, "owned_by": "muse_mlx",
                                                         "meta": self.model_meta()}]})

    def model_meta(self) -> dict:
        """llama-server's `meta` of /v1/models: the vocabulary's type (llama.cpp's enum) and size, a
        slot's context and the model's, the embedding width, the parameters and the tensors' bytes."""
        from gguf import GGML_QUANT_SIZES

        model = self.scheduler.model
        g, artifact = model.geometry, model.artifact
        n_params = size = 0
        for raw in artifact.tensors.values():
            n = 1
            for d in raw.shape:
                n *= d
            block, nbytes = GGML_QUANT_SIZES[raw.qtype]
            n_params, size = n_params + n, size + n // block * nbytes
        return {"vocab_type": VOCAB_TYPES.get(artifact.vocabulary.model, 0), "n_vocab": g.n_vocab,
                "n_ctx": self.scheduler.context, "n_ctx_train": g.context_length, "n_embd": g.n_embd,
                "n_params": n_params, "size": size}

    async def props(self, request):
        """llama-server's /props, the part that applies: slots, context, the defaults a request's
        sampling fields take (sampling_of with none given), the chat template, the kernel mode."""
        from dataclasses import asdict

        from starlette.responses import JSONResponse

        defaults = asdict(sampling_of(self.defaults, self.scheduler.model.geometry.n_vocab))
        defaults["temperature"] = defaults.pop("temp")
        defaults["logit_bias"] = []
        return JSONResponse({
            "total_slots": len(self.scheduler.slots), "model_alias": self.model_name,
            "default_generation_settings": {"n_ctx": self.scheduler.context, "params": defaults},
            "chat_template": self.tokenizer.chat_template, "batch_invariant": self.batch_invariant,
            "build_info": f"muse_mlx {__version__}"})

    async def tokenize(self, request):
        """llama-server's /tokenize: {"content", "add_special" (the BOS), "with_pieces"} -> {"tokens"},
        each token an id or, with pieces, {"id", "piece"}: the piece as text where its bytes are UTF-8,
        else as the list of its bytes (llama-server's rule)."""
        from starlette.responses import JSONResponse

        try:
            body = parse_json(await read_body(request, JSON_MAX_BYTES))
            content = body.get("content")
            if not isinstance(content, str):
                raise BadRequest("'content' must be a string", "content")
            add_special, pieces = (_boolean(body, name) for name in ("add_special", "with_pieces"))
            try:
                ids = await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode, content,
                                                                       add_special)
            except MuseError as exc:
                raise BadRequest(f"the content: {exc}", "content") from None
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        if not pieces:
            return JSONResponse({"tokens": ids})

        def piece(i: int):
            raw = self.tokenizer.token_bytes(i)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return list(raw)
        return JSONResponse({"tokens": [{"id": i, "piece": piece(i)} for i in ids]})

    async def detokenize(self, request):
        """llama-server's /detokenize: {"tokens": [ids]} -> {"content"}."""
        from starlette.responses import JSONResponse

        try:
            body = parse_json(await read_body(request, JSON_MAX_BYTES))
            tokens, n_vocab = body.get("tokens"), self.scheduler.model.geometry.n_vocab
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab
                                                       for t in tokens):
                raise BadRequest(f"'tokens' must be a list of token ids in 0..{n_vocab - 1}", "tokens")
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        return JSONResponse({"content": self.tokenizer.decode(tokens)})

    async def slots(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse(self.scheduler.describe())

    async def slot_action(self, request):
        from starlette.responses import JSONResponse

        try:
            index = int(request.path_params["id"])
            if not 0 <= index < len(self.scheduler.slots):
                raise ValueError
        except ValueError:
            return self.error(f"no slot {request.path_params['id']!r}", 404, "id", "not_found_error")
        action = request.query_params.get("action")
        if action not in ("save", "restore", "handoff", "erase"):
            return self.error("action must be save, restore, handoff or erase", 400, "action")
        if action == "erase":
            try:
                return JSONResponse(await asyncio.get_running_loop().run_in_executor(
                    None, self.scheduler.erase_slot, index))
            except MuseError as exc:
                return self.error(str(exc), 400, "id")
        if self.slot_save_path is None:
            return self.error("slot save/restore needs the server's --slot-save-path", 400, "action")
        try:
            body = parse_json(await read_body(request, JSON_MAX_BYTES))
            name = _plain_name(body.get("filename"))
            if action == "handoff":
                to = body.get("to")
                if not isinstance(to, str) or not to.startswith(("http://", "https://")):
                    raise BadRequest("'to' must be the receiving server's http(s) URL", "to")
                key, to_slot = body.get("api_key"), _integer(body, "slot", 0, 0, 3)
                if key is not None and not isinstance(key, str):
                    raise BadRequest("'api_key' must be a string", "api_key")
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        path = self.slot_save_path / name
        loop = asyncio.get_running_loop()
        try:
            if action == "handoff":
                result = await loop.run_in_executor(None, self._handoff, index, name, to, key, to_slot)
            elif action == "save":
                result = await loop.run_in_executor(None, self.scheduler.save_slot, index, path, self.model_id)
            else:
                result = await loop.run_in_executor(None, self.scheduler.restore_slot, index, path, self.model_id)
        except MuseError as exc:
            return self.error(str(exc), 400, "filename")
        except OSError as exc:
            verb = {"save": "written", "restore": "read", "handoff": "sent"}[action]
            return self.disk_error(exc, f"the slot's pack {name!r} could not be {verb}")
        return JSONResponse({**result, "filename": name})

    # ---- KV handoff: what a receiver holds, blobs and packs sent to it ----

    def _held_blobs(self) -> set[str]:
        root = self.slot_save_path
        return {f.name.removesuffix(".safetensors") for f in root.glob("*/blobs/*.safetensors")} | \
            {f.name.removesuffix(".safetensors") for f in root.glob(".incoming/blobs/*.safetensors")}

    def _prune_incoming(self) -> None:
        """Remove the blobs in .incoming that no pack took within incoming_ttl_s of their arrival
        (0: keep them), and any temporary file a write cut short left there as long."""
        if not self.incoming_ttl_s:
            return
        cutoff = time.time() - self.incoming_ttl_s
        for f in (self.slot_save_path / ".incoming" / "blobs").glob("*"):
            try:
                if f.stat().st_mtime < cutoff:
                    f.unlink()
            except OSError:   # gone meanwhile, or not ours to remove: the next put tries again
                pass

    async def kv_blobs(self, request):
        from starlette.responses import JSONResponse

        if self.slot_save_path is None:
            return self.error("KV handoff needs the server's --slot-save-path", 400)
        return JSONResponse({"blobs": sorted(self._held_blobs())})

    async def kv_put_blob(self, request):
        import hashlib

        from starlette.responses import JSONResponse

        from .kvpack import _is_name, _write_atomic

        if self.slot_save_path is None:
            return self.error("KV handoff needs the server's --slot-save-path", 400)
        name = request.path_params["name"]
        if not _is_name(name):
            return self.error("a blob's name is its SHA-256 (64 hex digits)", 400, "name")
        try:
            data = await read_body(request, self.blob_max_bytes, "the blob")
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        incoming = self.slot_save_path / ".incoming" / "blobs"

        def store() -> bool:   # off the event loop: a blob may be hundreds of MB to hash and write
            if hashlib.sha256(data).hexdigest() != name:
                return False
            self._prune_incoming()
            incoming.mkdir(parents=True, exist_ok=True)
            _write_atomic(incoming / f"{name}.safetensors", data)   # whole or not at all
            return True
        try:
            if not await asyncio.get_running_loop().run_in_executor(None, store):
                return self.error("the blob's bytes do not hash to its name", 400, "name")
        except OSError as exc:
            return self.disk_error(exc, f"the blob {name[:12]}... could not be stored")
        return JSONResponse({"stored": name, "bytes": len(data)})

    async def kv_put_pack(self, request):
        import shutil

        from starlette.responses import JSONResponse

        from . import kvpack

        if self.slot_save_path is None:
            return self.error("KV handoff needs the server's --slot-save-path", 400)
        try:
            name = _plain_name(request.path_params["filename"])
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        out = self.slot_save_path / name
        if out.exists():
            return self.error(f"a pack named {name!r} exists", 400, "filename")
        try:
            data = await read_body(request, kvpack.MANIFEST_MAX_BYTES, "the manifest")
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        try:
            out.mkdir()   # the name is this request's from here on (another put of it answers 400)
        except FileExistsError:
            return self.error(f"a pack named {name!r} exists", 400, "filename")
        except OSError as exc:
            return self.disk_error(exc, f"the pack {name!r} could not be written")
        try:   # off the event loop: the blobs' copies and the seal's hashing may take seconds
            pack = await asyncio.get_running_loop().run_in_executor(None, self._assemble_pack, out, data)
        except MuseError as exc:
            shutil.rmtree(out, ignore_errors=True)
            return self.error(str(exc), 400, "manifest")
        except OSError as exc:
            shutil.rmtree(out, ignore_errors=True)
            return self.disk_error(exc, f"the pack {name!r} could not be written")
        return JSONResponse({"filename": name, "n_tokens": pack.manifest["offset"]})

    def _assemble_pack(self, out: Path, manifest: bytes):
        """The pack `out` from its manifest and the blobs it names, each taken from .incoming (a
        handoff's) or from a pack held here; verified for this model, then the blobs it took from
        .incoming removed there (the pack holds them now, and /kv/blobs still lists them)."""
        import shutil

        from . import kvpack

        (out / "blobs").mkdir()
        (out / "manifest.json").write_bytes(manifest)
        pack = kvpack.read_manifest(out)
        incoming = self.slot_save_path / ".incoming"
        sources = [incoming] + [p for p in self.slot_save_path.iterdir()
                                if p.is_dir() and p != out and not p.name.startswith(".")]
        taken = []
        for blob in pack.blob_names():
            for d in sources:
                src = d / "blobs" / f"{blob}.safetensors"
                try:
                    shutil.copyfile(src, out / "blobs" / f"{blob}.safetensors")
                except FileNotFoundError:   # not there, or taken meanwhile by another pack: the next
                    continue
                if d == incoming:
                    taken.append(src)
                break
            else:
                raise kvpack.PackError(f"blob {blob[:12]}... was neither sent nor held")
        kvpack.check_for_model(pack, self.scheduler.model.geometry, self.model_id["fingerprint"])
        kvpack.verify(out)
        for src in taken:
            src.unlink(missing_ok=True)
        self._prune_incoming()
        return pack

    def _handoff(self, index: int, name: str, to: str, key: str | None, to_slot: int) -> dict:
        """Save slot `index` as a pack, send the receiver the blobs it lacks and the manifest, and
        have it restore the pack into its slot `to_slot` (runs in a worker thread)."""
        import httpx

        from . import kvpack

        saved = self.scheduler.save_slot(index, self.slot_save_path / name, self.model_id)
        pack = kvpack.read_manifest(self.slot_save_path / name)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with httpx.Client(base_url=to, headers=headers, timeout=600) as http:
                held = http.get("/kv/blobs")
                _ok(held, "list its blobs")
                missing = sorted(pack.blob_names() - set(held.json().get("blobs", [])))
                sent = 0
                for blob in missing:
                    data = (pack.path / "blobs" / f"{blob}.safetensors").read_bytes()
                    _ok(http.put(f"/kv/blobs/{blob}", content=data), "take a blob")
                    sent += len(data)
                manifest = (pack.path / "manifest.json").read_bytes()
                _ok(http.post(f"/kv/packs/{name}", content=manifest), "take the manifest")
                restored = http.post(f"/slots/{to_slot}?action=restore", json={"filename": name})
                _ok(restored, "restore the pack")
        except httpx.HTTPError as exc:
            raise MuseError(f"handoff to {to} failed: {type(exc).__name__}: {exc}") from None
        payload = kvpack._payload_of(pack, set(missing))
        return {"id_slot": index, "n_saved": saved["n_saved"], "blobs_sent": len(missing),
                "blobs_in_pack": len(pack.blob_names()), "bytes_sent": sent + len(manifest),
                "payload_bytes_sent": payload, "payload_bytes_full": kvpack.payload_bytes(pack.manifest),
                "receiver": restored.json()}

    # ---- completions ----

    async def completions(self, request):
        """OpenAI's /v1/completions."""
        try:
            body = parse_json(await read_body(request, JSON_MAX_BYTES))
            refuse_unserved(body)
            ids = await self._prompt_ids(body.get("prompt"))
            logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
            echo = _boolean(body, "echo")
            return await self._serve(request, body, ids, logprobs, chat=False, echo=echo)
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)

    async def llama_completion(self, request):
        """llama-server's own /completion (and /completions): its request fields (`n_predict`,
        `n_probs`, `return_tokens`, `id_slot`, a logit bias as [id, bias] pairs, ...) and its answer:
        `content`, `stop`, `stop_type`, `tokens_predicted`, ... (server-task.cpp's
        to_json_non_oaicompat); a stream is one JSON object an event, the last one with `stop`
        true and no `[DONE]` after it."""
        try:
            body = parse_json(await read_body(request, JSON_MAX_BYTES))
            refuse_unserved(body)
            ids = await self._prompt_ids(body.get("prompt"))
            n_probs = _integer(body, "n_probs", 0, 0, MAX_TOP_LOGPROBS)
            if _boolean(body, "echo"):
                raise BadRequest("'echo' is served on /v1/completions only", "echo")
            stream, return_tokens = _boolean(body, "stream"), _boolean(body, "return_tokens")
            (req,), events = self._submit(body, ids, n_probs if n_probs else None, chat=False, n_max=1,
                                          **await self._prepare(body))
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        except QueueFull as exc:
            return self.error(f"the server is busy: {exc}", 503, None, "server_busy", {"Retry-After": "1"})
        prompt_text = await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.decode, ids)
        settings = generation_settings(req, stream)

        def final(ev: dict, content: str, tokens: list[int], probs: list[dict] | None) -> dict:
            usage = ev["usage"]
            out = {"index": 0, "content": content, "tokens": tokens, "id_slot": ev.get("id_slot"), "stop": True,
                   "model": self.model_name, "tokens_predicted": usage["completion_tokens"],
                   "tokens_evaluated": usage["prompt_tokens"], "generation_settings": settings,
                   "prompt": prompt_text, "has_new_line": "\n" in content, "truncated": False,
                   "stop_type": ev["stop_type"], "stopping_word": ev["stopping_word"],
                   "tokens_cached": usage["prompt_tokens"] + usage["completion_tokens"], "timings": ev["timings"]}
            if probs:
                out["completion_probabilities"] = probs
            return out

        if stream:
            from sse_starlette.sse import EventSourceResponse

            async def chunks():
                finished, n, prompt_n = False, 0, len(ids)
                try:
                    while True:
                        _, ev = await events.get()
                        if "error" in ev:
                            status, kind = _error_kind(ev)
                            yield {"data": json.dumps({"error": {"message": ev["error"], "type": kind,
                                                                 "code": status}})}
                            finished = True
                            return
                        if "finish_reason" in ev:
                            yield {"data": json.dumps(final(ev, "", [], None))}
                            finished = True
                            return
                        if "token" in ev:
                            n += 1
                        if ev.get("text") or "token" in ev:
                            out = {"index": 0, "content": ev.get("text", ""),
                                   "tokens": [ev["token"]] if "token" in ev else [], "stop": False,
                                   "id_slot": -1, "tokens_predicted": n, "tokens_evaluated": prompt_n}
                            if "token" in ev and req.logprobs is not None:
                                out["completion_probabilities"] = [self._llama_prob(ev, req.post_sampling)]
                            yield {"data": json.dumps(out)}
                finally:
                    if not finished:
                        req.cancel()   # the client went away: the slot is freed at the next step
            return EventSourceResponse(chunks(), ping=15, send_timeout=30)

        from starlette.responses import JSONResponse

        got = await self._collect(request, [req], events)
        if not isinstance(got, list):
            return got
        (evs, last), = got
        tokens = [e["token"] for e in evs if "token" in e]
        probs = ([self._llama_prob(e, req.post_sampling) for e in evs if "token" in e] if req.logprobs is not None
                 else None)
        return JSONResponse(final(last, "".join(e.get("text", "") for e in evs), tokens if return_tokens else [],
                                  probs))

    async def chat(self, request):
        try:
            body = parse_json(await read_body(request, JSON_MAX_BYTES))
            refuse_unserved(body)
            if _boolean(body, "echo"):
                raise BadRequest("'echo' is served on /v1/completions only", "echo")
            fmt, tools = self._chat_format(body)
            ids = await self._encode(self._chat_prompt(body, tools, fmt), False, "messages")
            want = _boolean(body, "logprobs")
            top = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
            if top and not want:
                raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return await self._serve(request, body, ids, top if want else None, chat=True, fmt=fmt)
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)

    async def responses(self, request):
        """OpenAI's Responses API (muse_mlx/responses.py): the chat route under that API's request,
        answer and stream."""
        from . import responses

        try:
            body = parse_json(await read_body(request, JSON_MAX_BYTES))
            chat = responses.to_chat(body)
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        except responses.InputError as exc:
            return self.error(exc.message, 400, exc.param)
        return await self._serve_as(request, chat, lambda ids: responses.Rendering(self.model_name, body),
                                    {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"})

    async def anthropic_messages(self, request):
        """Anthropic's Messages API (muse_mlx/messages_api.py): the chat route under that API's request,
        answer and stream, as llama-server serves it."""
        from . import messages_api

        try:
            chat = messages_api.to_chat(parse_json(await read_body(request, JSON_MAX_BYTES)))
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        except messages_api.InputError as exc:
            return self.error(exc.message, 400, exc.param)
        return await self._serve_as(request, chat, lambda ids: messages_api.Rendering(self.model_name, len(ids)),
                                    {"stop": "stop_sequences"})

    async def anthropic_count_tokens(self, request):
        """Anthropic's /v1/messages/count_tokens: the prompt's tokens a Messages request would prefill."""
        from starlette.responses import JSONResponse

        from . import messages_api

        try:
            chat = messages_api.to_chat(parse_json(await read_body(request, JSON_MAX_BYTES)))
            ids = await self._encode(self._chat_prompt(chat, *self._chat_format(chat)[::-1]), False, "messages")
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        except messages_api.InputError as exc:
            return self.error(exc.message, 400, exc.param)
        return JSONResponse({"input_tokens": len(ids)})

    async def _serve_as(self, http, chat: dict, rendering_of, names: dict):
        """A chat request made from another API's (the Responses or Messages API), answered in that
        API's terms: `rendering_of(prompt ids)` renders its answer (`final`) and stream; `names` maps
        the chat's fields to that API's, so that an error names the field the client sent."""
        from starlette.responses import JSONResponse

        try:
            try:
                refuse_unserved(chat)
                fmt, tools = self._chat_format(chat)
                ids = await self._encode(self._chat_prompt(chat, tools, fmt), False, "messages")
                reqs, events = self._submit(chat, ids, None, chat=True, n_max=1, fmt=fmt, **await self._prepare(chat, fmt))
            except BadRequest as exc:
                param = names.get(exc.param, exc.param)
                raise BadRequest(exc.message.replace(f"'{exc.param}'", f"'{param}'"), param, exc.status) from None
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        except QueueFull as exc:
            return self.error(f"the server is busy: {exc}", 503, None, "server_busy", {"Retry-After": "1"})
        rendering = rendering_of(ids)
        if _boolean(chat, "stream"):
            from sse_starlette.sse import EventSourceResponse

            return EventSourceResponse(self._api_events(reqs, events, rendering, fmt), ping=15, send_timeout=30)
        got = await self._collect(http, reqs, events)
        if not isinstance(got, list):
            return got
        (evs, last), = got
        return JSONResponse(rendering.final(chat_format.message_of(fmt, "".join(e.get("text", "") for e in evs)), last))

    async def _api_events(self, reqs: list[Request], events: asyncio.Queue, rendering, fmt):
        """The stream of the Responses or Messages API (the rendering's): its opening events, the
        events of each of the answer's deltas (chat_format.AnswerStream's: reasoning, content, tool
        calls; the text as content where there is no format), then its closing events (or an error
        event)."""
        finished, parts = False, []
        answer = chat_format.AnswerStream(fmt, _call_id) if fmt is not None else None
        try:
            for event in rendering.opening():
                yield event
            while True:
                _, ev = await events.get()
                if "error" in ev:
                    yield rendering.failure(ev["error"], _error_kind(ev)[1])
                    break
                if "finish_reason" in ev:
                    for event in rendering.closing("".join(parts), ev):
                        yield event
                    finished = True
                    break
                if ev.get("text"):
                    for delta in [{"content": ev["text"]}] if answer is None else answer.push(ev["text"]):
                        parts.append(delta.get("content", ""))
                        for event in rendering.deltas(delta):
                            yield event
        finally:
            if not finished:   # an error, or the client went away: the slot is freed at the next step
                for req in reqs:
                    req.cancel()

    def _chat_format(self, body: dict) -> tuple[chat_format.ChatFormat | None, tuple]:
        """How the request's answer is read (chat_format.ChatFormat; None where the template is not
        muse-glimmer's: its text is the content) and the tools its prompt shows."""
        if not self.reads_answers:
            if body.get("continue_final_message") not in (None, False):
                raise BadRequest("'continue_final_message' needs muse-glimmer's chat template here", "continue_final_message")
            if body.get("tools") or body.get("tool_choice") not in (None, "auto", "none"):
                raise BadRequest("'tools' need a chat template with a tool-call format (muse-glimmer's ATEM "
                                 "markup); this model's template has none", "tools")
            if body.get("reasoning_format") not in (None, *chat_format.REASONING_FORMATS):
                raise BadRequest(f"'reasoning_format' must be one of {', '.join(chat_format.REASONING_FORMATS)}",
                                 "reasoning_format")
            return None, ()
        try:
            fmt, tools = chat_format.read_format(body, self.reasoning_format)
        except chat_format.FormatError as exc:
            raise BadRequest(exc.message, exc.param) from None
        if fmt.tools and any(body.get(k) not in (None, "") for k in ("grammar", "json_schema")) or (
                fmt.tools and isinstance(body.get("response_format"), dict)
                and body["response_format"].get("type") not in (None, "text")):
            raise BadRequest("'tools' cannot be used with a grammar, a JSON schema or a response_format", "tools")
        try:
            mode = chat_format.continuation(body, self.prefill_assistant)
        except chat_format.FormatError as exc:
            raise BadRequest(exc.message, exc.param) from None
        if mode is not None:
            if fmt.tools or grammar_request(body) is not None:
                raise BadRequest("continuing the last message under tools, a grammar or a JSON schema is not served "
                                 "here", "continue_final_message" if body.get("continue_final_message") else "messages")
            last = body["messages"][-1]
            reasoning = last.get("reasoning_content") or ""
            if not isinstance(reasoning, str):
                raise BadRequest("a message's 'reasoning_content' must be a string", "messages")
            content = "" if last.get("content") is None else message_text(last.get("content"), "\n\n")
            fmt = replace(fmt, prefill=chat_format.continued(mode, reasoning, content))
        return fmt, tools

    def _chat_prompt(self, body: dict, tools: tuple = (), fmt: chat_format.ChatFormat | None = None) -> str:
        """The request's `messages` rendered by the GGUF's chat template (in its sandbox), with
        llama-server's `chat_template_kwargs` (the template's own variables, e.g. muse-glimmer's
        `reasoning_strength`, `knowledge_cutoff`, `current_date`) and `add_generation_prompt`; the
        `tools` offered, an assistant message's `tool_calls` and a tool message's `tool_call_id` and
        `name`, as llama.cpp hands them to the template. An answer continued (fmt.prefill): the messages
        before the last without the generation prompt, then the answer's start with that message in it
        (common/parsers/muse-glimmer.cpp)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest("'messages' must be a list of {role, content} objects", "messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object of the template's variables",
                             "chat_template_kwargs")
        if set(kwargs) & TEMPLATE_INPUTS:
            raise BadRequest(f"'chat_template_kwargs' may not set {sorted(set(kwargs) & TEMPLATE_INPUTS)[0]!r}: the "
                             f"request gives it", "chat_template_kwargs")
        rendered = []
        for i, m in enumerate(messages):
            calls = m.get("tool_calls") if m["role"] == "assistant" else None
            content = m.get("content")
            message = {"role": m["role"], "content": "" if content is None and calls else message_text(content)}
            if m.get("reasoning_content") is not None:   # an assistant turn's reasoning, as llama-server passes it
                if not isinstance(m["reasoning_content"], str):
                    raise BadRequest("a message's 'reasoning_content' must be a string", "messages")
                message["reasoning_content"] = m["reasoning_content"]
            if calls:
                try:
                    message["tool_calls"] = chat_format.template_tool_calls(calls, i)
                except chat_format.FormatError as exc:
                    raise BadRequest(exc.message, exc.param) from None
            for key in ("tool_call_id", "name") if m["role"] == "tool" else ():
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise BadRequest(f"a tool message's '{key}' must be a string", "messages")
                    message[key] = m[key]
            rendered.append(message)
        if tools:
            kwargs = {**kwargs, "tools": [t.as_template_input() for t in tools]}
        generation_prompt = _boolean(body, "add_generation_prompt", True)
        continued = fmt is not None and fmt.prefill
        try:
            text = self.tokenizer.apply_chat_template(rendered[:-1] if continued else rendered,
                                                      add_generation_prompt=generation_prompt and not continued, **kwargs)
            return text + chat_format.START + fmt.prefill if continued else text
        except MuseError as exc:
            raise BadRequest(f"the chat template failed: {exc}", "messages") from None

    async def apply_template(self, request):
        """llama-server's /apply-template: {"messages"} -> {"prompt"}, the text a chat request with
        those messages is prefilled with."""
        from starlette.responses import JSONResponse

        try:
            body = parse_json(await read_body(request, JSON_MAX_BYTES))
            return JSONResponse({"prompt": self._chat_prompt(body, *self._chat_format(body)[::-1])})
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)

    async def _encode(self, text: str, add_bos: bool | None, param: str) -> list[int]:
        """A prompt's token ids, tokenized on a worker thread (the tokenizer releases the GIL), after
        refusing at once a text whose bytes alone prove it longer than a slot (each token is at most
        `max_token_bytes` of it): a 64 MiB prompt took ~1 s a MB on the event loop, every stream
        stalled, to be refused anyway."""
        context = self.scheduler.context
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        if n_bytes > context:
            least = -(-n_bytes // self.tokenizer.max_token_bytes)
            if least > context:
                raise BadRequest(f"the prompt is at least {least:,} tokens ({n_bytes:,} bytes), longer than the "
                                 f"slot's context of {context:,} positions", param)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode, text, add_bos)
        except MuseError as exc:   # not Unicode (a lone surrogate from a JSON escape)
            raise BadRequest(f"the {param}: {exc}", param) from None

    async def _prompt_ids(self, prompt) -> list[int]:
        """A completion's prompt, as llama-server takes one: a string (tokenized with the model's
        BOS rule), a list of token ids, or one list mixing ids and strings (only a string at its
        start gets the BOS; server-common.cpp's tokenize_mixed); a list holding one of these is it.
        A list of several strings or lists is several prompts: one a request is served."""
        n_vocab = self.scheduler.model.geometry.n_vocab

        def is_id(p) -> bool:
            return isinstance(p, int) and not isinstance(p, bool)
        if isinstance(prompt, str):
            return await self._encode(prompt, None, "prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return await self._prompt_ids(prompt[0])
        if isinstance(prompt, list) and prompt and any(is_id(p) for p in prompt) and \
                all(is_id(p) or isinstance(p, str) for p in prompt):
            ids: list[int] = []
            for i, p in enumerate(prompt):
                if isinstance(p, str):
                    ids += await self._encode(p, None if i == 0 else False, "prompt")
                elif not 0 <= p < n_vocab:
                    raise BadRequest(f"'prompt' token ids must be in 0..{n_vocab - 1}, got {p}", "prompt")
                else:
                    ids.append(p)
            return ids
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise BadRequest(f"'prompt' holds {len(prompt)} prompts; one a request is served", "prompt")
        raise BadRequest("'prompt' must be a string, a list of token ids, or a list of token ids and strings",
                         "prompt")

    async def _prepare(self, body: dict, fmt: chat_format.ChatFormat | None = None) -> dict:
        """What a request's sampler needs made off the event loop and the engine's thread: its grammar
        (`constraint`) and DRY's sequence breakers as tokens (`breakers`: a set's first use reads the
        whole vocabulary)."""
        constraint = await self._constraint(body, fmt)
        sampling = sampling_of(with_defaults(body, self.defaults), self.scheduler.model.geometry.n_vocab)
        breakers = None
        if sampling.dry:
            breakers = await asyncio.get_running_loop().run_in_executor(
                None, self.tokenizer.dry_breakers, sampling.dry_sequence_breakers)
        return {"constraint": constraint, "breakers": breakers}

    async def _constraint(self, body: dict, fmt: chat_format.ChatFormat | None = None):
        """The request's grammar compiled (grammar.Constraint), or None; on a worker thread (llguidance
        drops the GIL while it compiles: a large grammar takes up to a second). With a chat format
        (muse-glimmer's template), tools hold a call to their grammar (from the first token with
        tool_choice required, else from the trigger on), and a JSON schema holds the answer's message
        (its reasoning messages free), as llama.cpp's chat layer builds them."""
        asked = grammar_request(body)
        if fmt is not None and fmt.tools:
            asked = ("lark", None, "tools")
        elif asked is None:
            return None

        def compile_it():
            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = Grammars(self.tokenizer)
            grammars = self._grammars
            if fmt is not None and fmt.tools:
                text = chat_format.tools_grammar(fmt, grammars.special_id)
                if fmt.required:
                    return grammars.compile("lark", text, "the tools' grammar")
                return grammars.lazy("lark", text, "the tools' grammar", chat_format.TRIGGER, ">")
            if fmt is not None and asked[0] == "json_schema":
                return grammars.compile("lark", chat_format.answer_grammar(asked[1], grammars.special_id), asked[2])
            return grammars.compile(*asked)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, compile_it)
        except GrammarError as exc:
            raise BadRequest(str(exc), asked[2]) from None

    def _submit(self, body: dict, ids: list[int], logprobs: int | None, chat: bool,
                n_max: int = MAX_CHOICES, prompt_logprobs: int | None = None,
                constraint=None, fmt: chat_format.ChatFormat | None = None,
                breakers=None) -> tuple[list[Request], asyncio.Queue]:
        """The request's fields read and checked (BadRequest names the one that is wrong), then its
        `n` choices queued for slots (QueueFull when the queue is: none of them then stays). Choice i
        samples with the seed plus i (one seed, n different samples, each reproducible). Their
        events arrive on one queue as (choice, event)."""
        context = self.scheduler.context
        default_max = context - len(ids)
        if all(body.get(n) is None for n in ("max_completion_tokens", "max_tokens", "n_predict")):
            body = with_defaults(body, {"n_predict": self.defaults.get("n_predict")})   # -n's
        name = next((n for n in (*(("max_completion_tokens",) if chat else ()), "max_tokens", "n_predict")
                     if body.get(n) is not None), "max_tokens")
        max_tokens = _integer(body, name, min(default_max, 4096) if chat else 16, -1 if name == "n_predict" else 0,
                              1 << 30)
        if max_tokens < 0:   # llama-server's n_predict = -1: until the slot is full
            max_tokens = default_max
        sampling = sampling_of(with_defaults(body, self.defaults), self.scheduler.model.geometry.n_vocab)
        stops = stops_of(body)
        n = _integer(body, "n_cmpl" if body.get("n_cmpl") is not None else "n", 1, 1, n_max)   # n_cmpl: llama-server's name
        _boolean(body, "stream")
        _boolean(body, "cache_prompt", True)   # llama-server's: a prompt's reuse here is automatic
        ignore_eos = _boolean(body, "ignore_eos")
        post_sampling = _boolean(body, "post_sampling_probs")
        t_max = _integer(body, "t_max_predict_ms", -1, -1, 1 << 53)   # llama-server's time limit (<= 0: none)
        if not ids:
            raise BadRequest("the prompt is empty", "prompt" if not chat else "messages")
        if len(ids) > context:
            raise BadRequest(f"the prompt is {len(ids):,} tokens, longer than the slot's context of {context:,} "
                             f"positions", "prompt" if not chat else "messages")
        slot = _integer(body, "id_slot", -1, -1, len(self.scheduler.slots) - 1)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        reqs = [Request(ids, max_tokens, replace(sampling, seed=sampling.seed + i),
                        lambda ev, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, ev)), stop_strings=stops,
                        logprobs=logprobs, slot=None if slot < 0 else slot, ignore_eos=ignore_eos,
                        prompt_logprobs=prompt_logprobs, post_sampling=post_sampling, t_max_predict_ms=t_max,
                        constraint=constraint if i == 0 or constraint is None else constraint.copy(),
                        dry_breakers=breakers,
                        shown=self._shown if fmt is not None else frozenset())
                for i in range(n)]
        for req in reqs[1:] if prompt_logprobs is None else ():   # the others copy the first's prefilled prompt
            req.leader = reqs[0]
        try:
            for req in reqs:
                self.scheduler.submit(req)
        except QueueFull:
            for req in reqs:
                req.cancel()
            raise
        return reqs, events

    async def _collect(self, http, reqs: list[Request], events: asyncio.Queue):
        """The choices' events up to their ends: per choice (its token and text events, its
        finishing event), or the response to give instead (the engine's error; 499 when the client
        went away)."""
        from starlette.responses import JSONResponse

        evs: list[list[dict]] = [[] for _ in reqs]
        last: list[dict | None] = [None] * len(reqs)
        ended = False
        try:
            while not all(last):
                try:
                    i, ev = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    continue
                if "error" in ev:
                    status, kind = _error_kind(ev)
                    return self.error(ev["error"], status, None, kind)
                if "finish_reason" in ev:
                    last[i] = ev
                else:
                    evs[i].append(ev)
            ended = True
            return list(zip(evs, last))
        finally:
            if not ended:   # an error, the client went away, or this task was cancelled: free the slots
                for req in reqs:
                    req.cancel()

    async def _serve(self, http, body: dict, ids: list[int], logprobs: int | None, chat: bool, echo: bool = False,
                     fmt: chat_format.ChatFormat | None = None):
        """OpenAI's answer; with `echo` (completions) the prompt's text comes first, and with
        logprobs each prompt token's log-prob too (the first's None: nothing predicts it), as
        OpenAI's legacy completions gave them for scoring a text (max_tokens 0). `fmt`: how a chat
        answer is read into its reasoning, content and tool calls (None: the text is the content)."""
        from starlette.responses import JSONResponse

        if not chat and _boolean(body, "post_sampling_probs"):
            return self.error("'post_sampling_probs' is served on /completion and /v1/chat/completions",
                              400, "post_sampling_probs")
        try:
            reqs, events = self._submit(body, ids, logprobs, chat,
                                        prompt_logprobs=logprobs if echo and logprobs is not None else None,
                                        fmt=fmt, **await self._prepare(body, fmt))
        except QueueFull as exc:
            return self.error(f"the server is busy: {exc}", 503, None, "server_busy", {"Retry-After": "1"})
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if _boolean(body, "stream"):
            from sse_starlette.sse import EventSourceResponse

            echoed = self.tokenizer.decode(ids) if echo else None
            return EventSourceResponse(self._stream(reqs, events, rid, created, chat, body, echoed, fmt),
                                       ping=15, send_timeout=30)
        got = await self._collect(http, reqs, events)
        if not isinstance(got, list):
            return got
        echoed = self.tokenizer.decode(ids) if echo else ""
        choices = []
        for index, (evs, last) in enumerate(got):
            lps = _prompt_events(evs) + [e for e in evs if "token" in e]
            content = echoed + "".join(e.get("text", "") for e in evs)
            choice = {"index": index, "finish_reason": last["finish_reason"]}
            if chat:
                answer = chat_format.message_of(fmt, content)
                choice["message"] = self._chat_message(answer)
                if answer.tool_calls and last["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
                choice["logprobs"] = ({"content": [self._chat_lp(e, reqs[index].post_sampling) for e in lps]}
                                      if logprobs is not None else None)
            else:
                choice["text"] = content
                choice["logprobs"] = self._completion_lps(lps) if logprobs is not None else None
            if len(got) > 1:   # each choice's own slot and timings
                choice["id_slot"], choice["timings"] = last.get("id_slot"), last["timings"]
            choices.append(choice)
        lasts = [last for _, last in got]
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": self.model_name, "choices": choices, "usage": _usage(lasts)}
        if len(got) == 1:
            out["timings"], out["id_slot"] = lasts[0]["timings"], lasts[0].get("id_slot")
        return JSONResponse(out)

    @staticmethod
    def _chat_message(answer: chat_format.Message) -> dict:
        """A chat answer as OpenAI's message (llama-server's: `reasoning_content` where there is any)."""
        message = {"role": "assistant", "content": answer.content}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.tool_calls:
            message["tool_calls"] = [{"id": _call_id(), "type": "function",
                                      "function": {"name": name, "arguments": arguments}}
                                     for name, arguments in answer.tool_calls]
        return message

    async def _stream(self, reqs: list[Request], events: asyncio.Queue, rid: str, created: int, chat: bool,
                      body: dict, echoed: str | None = None, fmt: chat_format.ChatFormat | None = None):
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage")
        logprobs = reqs[0].logprobs
        answers = [chat_format.AnswerStream(fmt, _call_id) for _ in reqs] if chat and fmt is not None else None

        def chunk(index, delta_text=None, finish=None, ev=None, role=False, last=None, evs=None, delta=None):
            if chat:
                if delta is None:
                    delta = {"role": "assistant"} if role else ({"content": delta_text} if delta_text else {})
                c = {"index": index, "delta": delta, "finish_reason": finish}
                if ev is not None and logprobs is not None:
                    c["logprobs"] = {"content": [self._chat_lp(ev, reqs[index].post_sampling)]}
            else:
                c = {"index": index, "text": delta_text or "", "finish_reason": finish}
                if (ev is not None or evs is not None) and logprobs is not None:
                    c["logprobs"] = self._completion_lps(evs if evs is not None else [ev])
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [c]}
            if last is not None:   # a choice's last chunk, as llama-server's: the timings and the slot
                out["timings"], out["id_slot"] = last.get("timings"), last.get("id_slot")
            return {"data": json.dumps(out)}
        lasts: list[dict | None] = [None] * len(reqs)
        # echo: each choice's first chunk is the prompt's text (with its tokens' log-probs, which
        # arrive as the prompt is prefilled, when asked for: then it is sent before the first token)
        prompt_evs: list[list[dict] | None] = [[] if echoed is not None else None for _ in reqs]
        finished = False
        try:
            if chat:
                for index in range(len(reqs)):
                    yield chunk(index, role=True)
            if echoed is not None and reqs[0].prompt_logprobs is None:
                for index in range(len(reqs)):
                    yield chunk(index, echoed)
                prompt_evs = [None] * len(reqs)
            while not all(lasts):
                index, ev = await events.get()
                if "prompt_logprobs" in ev:
                    prompt_evs[index].append(ev)
                    continue
                if prompt_evs[index] is not None:
                    yield chunk(index, echoed, evs=_prompt_events(prompt_evs[index]))
                    prompt_evs[index] = None
                if "error" in ev:
                    yield {"data": json.dumps({"error": {"message": ev["error"], "type": _error_kind(ev)[1],
                                                         "param": None, "code": None}})}
                    break
                if "finish_reason" in ev:
                    lasts[index] = ev
                    finish = ev["finish_reason"]
                    if answers is not None and finish == "stop" and answers[index].message().tool_calls:
                        finish = "tool_calls"
                    yield chunk(index, finish=finish, last=ev)
                elif answers is not None:   # the answer's reasoning, content and tool calls as they grow
                    deltas = answers[index].push(ev.get("text", ""))
                    token_ev = ev if "token" in ev else None
                    if not deltas and token_ev is not None and logprobs is not None:
                        yield chunk(index, ev=token_ev)
                    for k, d in enumerate(deltas):
                        yield chunk(index, delta=d, ev=token_ev if k == 0 else None)
                elif ev.get("text") or "token" in ev:
                    yield chunk(index, ev.get("text", ""), ev=ev if "token" in ev else None)
            else:
                finished = True
                if include_usage:
                    yield {"data": json.dumps({"id": rid, "object": obj, "created": created,
                                               "model": self.model_name, "choices": [], "usage": _usage(lasts)})}
            yield {"data": "[DONE]"}
        finally:
            if not finished:   # an error, or the client went away: the slots are freed at the next step
                for req in reqs:
                    req.cancel()

    def _token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _llama_prob(self, ev: dict, post_sampling: bool = False) -> dict:
        """A token's entry of llama-server's `completion_probabilities`: log-probs of the model's
        distribution before sampling, or with its post_sampling_probs the probabilities of what the
        pick drew from (`prob`, `top_probs`: the candidates the chain left, most likely first)."""
        key = "prob" if post_sampling else "logprob"

        def entry(t: int, lp: float) -> dict:
            text, raw = self._token_text(t)
            return {"id": t, "token": text, "bytes": raw, key: math.exp(lp) if post_sampling else lp}
        top = ev.get("top_logprobs", [])
        if post_sampling:   # llama-server leaves out the candidates of probability 0
            top = [(t, lp) for t, lp in top if lp != -math.inf]
        return {**entry(ev["token"], ev["logprob"]), f"top_{key}s": [entry(t, lp) for t, lp in top]}

    def _chat_lp(self, ev: dict, post_sampling: bool = False) -> dict:
        if post_sampling:   # llama-server's entry then (probs_vector_to_json) on every route
            return self._llama_prob(ev, True)
        text, raw = self._token_text(ev["token"])
        top = [{"token": self._token_text(t)[0], "logprob": lp, "bytes": self._token_text(t)[1]}
               for t, lp in ev.get("top_logprobs", [])]
        return {"token": text, "logprob": ev["logprob"], "bytes": raw, "top_logprobs": top}

    def _completion_lps(self, evs: list[dict]) -> dict:
        tokens = [self._token_text(e["token"])[0] for e in evs]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        def top(e):   # keyed by text, as OpenAI's format is: tokens of one text keep the most likely
            if e["logprob"] is None:   # an echoed prompt's first token
                return None
            out: dict[str, float] = {}
            for t, lp in e.get("top_logprobs", []):
                out.setdefault(self._token_text(t)[0], lp)
            return out
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in evs],
                "top_logprobs": [top(e) for e in evs], "text_offset": offsets}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _plain_name(name) -> str:
    """A pack's name as the client gave it: one path component, no leading dot, at most 200
    characters, all printable (no NUL, which no file name holds, no other control or format
    character, no lone surrogate from a JSON escape, which no file system encoding takes)."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith(".") or len(name) > 200 \
            or not name.isprintable():
        raise BadRequest("'filename' must be a plain file name", "filename")
    return name


def _ok(response, what: str) -> None:
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise MuseError(f"the receiver did not {what}: {response.status_code} {message}")


class _AuthMiddleware:
    """An API key on every route but /health (when the server has any): `Authorization: Bearer KEY`,
    or, where that header is absent, `X-Api-Key: KEY` (Anthropic's clients' header); any of the
    server's keys (--api-key's list, --api-key-file's lines)."""

    def __init__(self, app, app_state: App):
        self.app, self.state = app, app_state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.state.api_keys and scope["path"] != "/health":
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization")
            if given is None:   # Anthropic's clients send the key as X-Api-Key (llama-server takes either)
                given = b"Bearer " + headers.get(b"x-api-key", b"")
            matches = [hmac.compare_digest(given, b"Bearer " + key.encode("utf-8", "surrogateescape"))
                       for key in self.state.api_keys]   # each in constant time, all of them compared
            if not any(matches):
                response = App.error("invalid or missing API key (Authorization: Bearer ..., or X-Api-Key)", 401, None,
                                     "authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build(args, config: KernelConfig | None = None) -> tuple[App, Scheduler]:
    """The app and its scheduler from the command's arguments (config: the kernel values, parsed
    from them when not given)."""
    from . import kvpack
    from .model import load
    from .prompt_cache import PromptCache
    from .tokenizer import MuseTokenizer, read_chat_template_file
    from .default_model import default_model_path
    from .tools.fixtures import cache_dir

    model_path = args.model if args.model is not None else default_model_path()
    if config is None:
        config = KernelConfig.parse(getattr(args, "kernel_config", ""), getattr(args, "batch_invariant", False))
    model = load(model_path, backend="reference" if args.reference else "auto", kernel_config=config)
    g = model.geometry
    context = min(args.ctx_size or g.context_length, g.context_length)
    template = getattr(args, "chat_template_file", None)
    tokenizer = MuseTokenizer(model.artifact.vocabulary,
                              read_chat_template_file(template) if template is not None else None)
    model_id = {"fingerprint": kvpack.fingerprint(model_path, cache_dir()), "architecture": "muse-glimmer"}
    pc = None
    if args.prompt_cache is not None:
        pc = PromptCache(args.prompt_cache or cache_dir() / "prompts", model_id, g, upload=model.ops.upload)
    scheduler = Scheduler(model, tokenizer, args.parallel, context, queue_max=args.queue, prompt_cache=pc)
    save_path = Path(args.slot_save_path) if args.slot_save_path else None
    if save_path is not None and not save_path.is_dir():
        raise MuseError(f"--slot-save-path {save_path}: not a folder")
    ttl = getattr(args, "kv_incoming_ttl", INCOMING_TTL_S)
    aliases, keys = getattr(args, "alias", None) or (), getattr(args, "api_keys", None)
    app = App(scheduler, tokenizer, aliases[0] if aliases else Path(model_path).name,
              keys if keys is not None else api_keys(args.api_key, getattr(args, "api_key_file", None)),
              model_id, save_path, ttl,
              bool(config.batch_invariant), bool(getattr(args, "metrics", False)),
              getattr(args, "reasoning_format", "auto"))
    app.aliases = tuple(aliases)
    app.defaults = request_defaults(args)
    app.prefill_assistant = not getattr(args, "no_prefill_assistant", False)
    return app, scheduler


def request_defaults(args) -> dict:
    """The request fields' defaults the command line sets (llama-server's sampling flags and -n), checked
    as a request's fields are: MuseError names the flag."""
    out = {field: getattr(args, flag[2:].replace("-", "_"), None) for flag, field, _ in SAMPLING_FLAGS}
    out = {k: v for k, v in out.items() if v is not None}
    try:
        sampling_of(out, 1)   # (no logit bias among them: the vocabulary's size is not asked)
    except BadRequest as exc:
        flag = next(f for f, field, _ in SAMPLING_FLAGS if field == exc.param)
        raise MuseError(f"{flag}: {exc.message.replace(repr(exc.param), 'the value')}") from None
    order = samplers_flags(args)
    if order is not None:
        out["samplers"] = order
    if getattr(args, "dry_sequence_breaker", None) is not None:
        out["dry_sequence_breakers"] = breakers_of_flags(args.dry_sequence_breaker)
        problems = sampling_of(out, 1).problems()
        if problems:
            raise MuseError(problems[0])
    n_predict = getattr(args, "n_predict", None)
    if n_predict is not None:
        if n_predict < -1:
            raise MuseError(f"--n-predict must be -1 (until the slot is full) or >= 0, got {n_predict}")
        out["n_predict"] = n_predict
    return out


KEY_FILE_MAX_BYTES = 1 << 20


def api_keys(listed: str | None, path: str | None) -> tuple[str, ...]:
    """llama-server's keys: --api-key's comma-separated list (CSV: a key may be quoted) and
    --api-key-file's lines (empty lines and lines starting with '#' skipped). MuseError names a file
    that cannot be read."""
    import csv

    keys = []
    if listed is not None:
        keys += [k for row in csv.reader([listed]) for k in row if k]
    if path is not None:
        data = cli.read_flag_file("--api-key-file", path, KEY_FILE_MAX_BYTES)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MuseError(f"--api-key-file {path}: not UTF-8 (byte {exc.start})") from None
        keys += [line for line in text.splitlines() if line and not line.startswith("#")]
    return tuple(keys)


def _aliases(text: str) -> list[str]:
    """--alias: comma-separated names, stripped, empty ones dropped (llama-server's)."""
    return [a.strip() for a in text.split(",") if a.strip()]


def _command(argv=None) -> int:
    p = Parser(prog="python -m muse_mlx.server", description=__doc__.splitlines()[0])
    p.add_argument("--model", "-m", help="a muse-glimmer GGUF (default: the embedded fixture)")
    p.add_argument("--alias", "-a", type=_aliases, metavar="NAME[,NAME...]",
                   help="the model's names in the API (llama-server's: the first is its id in /v1/models and in "
                        "every answer; default the GGUF's file name)")
    p.add_argument("--parallel", "-np", type=int, default=1, help="slots, 1..4 (default 1)")
    p.add_argument("--ctx-size", "-c", type=int,
                   help="positions per slot (default, 0 and most: the model's limit, as llama-server's 0)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", metavar="KEY[,KEY...]",
                   help="require 'Authorization: Bearer KEY' on every route but /health; several keys "
                        "comma-separated (llama-server's)")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="more keys, one a line ('#' starts a comment line; llama-server's)")
    for flag, field, kind in SAMPLING_FLAGS:
        p.add_argument(flag, type=kind, metavar="N" if kind is int else "X",
                       help=f"the default of a request's '{field}' (llama-server's flag)")
    p.add_argument("--dry-sequence-breaker", action="append", metavar="TEXT",
                   help="the default of a request's 'dry_sequence_breakers'; repeatable, replacing llama.cpp's "
                        "defaults; 'none': no breakers (llama-server's flag)")
    add_samplers_flags(p)
    p.add_argument("--n-predict", "-n", type=int, metavar="N",
                   help="the default of a request's token limit where it gives none (-1: until the slot is full)")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait for a slot; more get 503 (default 16)")
    p.add_argument("--prompt-cache", nargs="?", const="", metavar="DIR", help="reuse stored prompt prefixes (kvpack)")
    p.add_argument("--slot-save-path", metavar="DIR", help="folder for POST /slots/{id}?action=save|restore")
    p.add_argument("--kv-incoming-ttl", type=float, default=INCOMING_TTL_S, metavar="SECONDS",
                   help="remove a handoff's blob that no pack took within this many seconds of its arrival "
                        f"(0: keep; default {INCOMING_TTL_S:.0f})")
    p.add_argument("--chat-template-file", metavar="FILE",
                   help="a Jinja chat template for the chat route in place of the GGUF's (llama-server's flag)")
    p.add_argument("--reasoning-format", default="auto", choices=chat_format.REASONING_FORMATS,
                   help="a muse-glimmer chat answer's reasoning: split into 'reasoning_content' (auto, deepseek, "
                        "deepseek-legacy) or left in the content (none); a request's reasoning_format overrides "
                        "it (default auto, llama-server's)")
    p.add_argument("--no-prefill-assistant", action="store_true",
                   help="a chat's last message from the assistant starts a new answer rather than being continued "
                        "(llama-server's flag)")
    p.add_argument("--metrics", action="store_true", help="serve GET /metrics (Prometheus text, llama-server's names)")
    p.add_argument("--reference", action="store_true", help="the MLX-ops reference backend even on a GPU")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every slot's logits the same bits as its solo run's whatever the other slots hold "
                        "(the kernel path: one row takes the tensor-core form too, slower at one slot; "
                        "KernelConfig.batch_invariant; docs/server.md)")
    p.add_argument("--kernel-config", default="", metavar="NAME=VALUE,...",
                   help="GPU kernel values (muse_mlx.config.KernelConfig), as generate takes them")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up (a short prefill and a decode step over every slot count) before listening")
    args = p.parse_args(argv)
    if not 1 <= args.parallel <= 4:
        raise MuseError(f"--parallel must be 1..4, got {args.parallel}")
    if args.ctx_size is not None and args.ctx_size < 0:
        raise MuseError(f"--ctx-size must be >= 1, or 0 for the model's limit, got {args.ctx_size}")
    if not 0 <= args.port <= 65535:
        raise MuseError(f"--port must be 0..65535, got {args.port}")
    if args.queue < 0:
        raise MuseError(f"--queue must be >= 0, got {args.queue}")
    if not (args.kv_incoming_ttl >= 0 and math.isfinite(args.kv_incoming_ttl)):
        raise MuseError(f"--kv-incoming-ttl must be a finite number of seconds >= 0, got {args.kv_incoming_ttl}")
    if args.alias is not None and not args.alias:
        raise MuseError("--alias names no model name")
    args.api_keys = api_keys(args.api_key, args.api_key_file)   # a bad key file is refused before the weights load
    request_defaults(args)   # so are bad sampling flags
    if (args.api_key is not None or args.api_key_file is not None) and not args.api_keys:
        raise MuseError("--api-key / --api-key-file give no key")
    config = KernelConfig.parse(args.kernel_config, args.batch_invariant)   # refused before the weights load
    if args.chat_template_file is not None:   # so is a chat template file that cannot be read or compiled
        from .tokenizer import compile_chat_template, read_chat_template_file
        compile_chat_template(*read_chat_template_file(args.chat_template_file))
    app, scheduler = build(args, config)
    import uvicorn

    scheduler.thread.start()
    try:
        warm = "" if args.no_warmup else f"; warm-up {scheduler.warm_up():.2f} s"
        exact = "; batch-invariant" if config.batch_invariant else ""
        print(f"muse_mlx server: {app.model_name}, {len(scheduler.slots)} slot(s) x {scheduler.context:,} positions, "
              f"KV {scheduler.kv_bytes:,} bytes held{exact}{warm}; http://{args.host}:{args.port}", file=sys.stderr,
              flush=True)
        uvicorn.run(app.starlette(), host=args.host, port=args.port, log_level="warning")
    finally:
        scheduler.stop()
        scheduler.thread.join(60)   # the step in flight ends before the process does
    return 0


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    cli.exit_now(main())
