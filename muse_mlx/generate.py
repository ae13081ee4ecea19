"""`python -m muse_mlx.generate`: stream text from a muse-glimmer GGUF.

Generated text goes to stdout and nothing else does; the statistics go to stderr
at the end. A user error (missing file, bad GGUF, bad flag value, a prompt past
the context) prints one line to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from .errors import ContextLimitError, MuseError, NonFiniteError
from . import cli
from .cli import Parser
from .config import KernelConfig
from .geometry import PREFILL_CHUNK
from .kv import SlotCache
from .sampling import (DEFAULT_SAMPLERS, Sampler, SamplerSettings, add_samplers_flags, all_finite, breakers_of_flags,
                       samplers_flags)

DEFAULT_PROMPT = "A list is"


def generate_tokens(model, cache: SlotCache, prompt_ids: list[int], sampler: Sampler, max_tokens: int,
                    stop_ids=frozenset()) -> Iterator[int]:
    """Prefill the prompt, then sample up to `max_tokens` tokens (decode_tokens)."""
    logits = model.prefill(prompt_ids, cache)
    yield from decode_tokens(model, cache, logits[-1], sampler, max_tokens, stop_ids)


def decode_tokens(model, cache: SlotCache, logits: mx.array, sampler: Sampler, max_tokens: int,
                  stop_ids=frozenset()) -> Iterator[int]:
    """From the logits of the cache's last position, up to `max_tokens` tokens, stopping at a stop
    id or a full cache (the one decode loop: generate, the parity harness and the bench run it).

    Every step's logits are checked finite (one reduction, read with the token it gives): a
    non-finite row raises NonFiniteError naming its position instead of sampling from it.

    Pipelined: the step that feeds token t back is built from t's lazy value and submitted
    (mx.async_eval) before t is read, so the host prepares step t+1 while the GPU computes
    step t (as mlx-lm generates). The first token alone is read before its step is built: it
    shows as soon as the prompt is done, not after that step's build (a process's first
    compiled step is traced then, ~0.3 s on the H200) and computation. The tokens are those of
    feeding each token back only after reading it. The cache contract: it holds the prompt and
    every token fed back, which includes a stop token read while its step was under way (any
    but the first), but not the last token when max_tokens or the context ends the run.

    With a grammar (the sampler's constraint) or DRY (the sampler is paced) a token's pick is built
    once the token before it is read (the mask and the penalty follow the tokens so far), and
    submitted alone ahead of the step fed from it; the run also ends where the grammar takes
    nothing more."""
    position = cache.offset - 1
    paced, constrained = sampler.paced, sampler.constraint is not None
    token, finite = sampler.token(logits), all_finite(logits)

    def submit(token: mx.array):
        step_logits = model.step(token, cache)
        if paced:   # the pick waits for `token`'s read: the grammar's mask and DRY follow the tokens
            finite = all_finite(step_logits)
            mx.async_eval(step_logits, finite)
            return (lambda: sampler.token(step_logits)), finite
        following = (sampler.token(step_logits), all_finite(step_logits))
        mx.async_eval(*following)
        return following
    for i in range(max_tokens):
        if callable(token):   # a paced pick, made once the token before it was read
            token = token()
            mx.async_eval(token)   # alone, ahead of the step fed from it
        more = i + 1 < max_tokens and cache.room > 0
        following = submit(token) if more and i > 0 else None
        if not finite.item():
            raise NonFiniteError(position)
        value = int(token.item())
        if value in stop_ids:
            return
        sampler.read(value)
        yield value
        if constrained and sampler.constraint.done:   # the grammar takes nothing more
            return
        if more and following is None:   # the first token, shown before its step is built
            following = submit(token)
        if following is None:
            return
        (token, finite), position = following, position + 1


@dataclass
class Stats:
    load_seconds: float = 0.0
    load_parts: tuple[float, float, float] = (0.0, 0.0, 0.0)   # the file opened and checked, weights, tokenizer wait
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prompt_seconds: float = 0.0
    first_token_seconds: float = 0.0
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    stopped_by: str = "max-tokens"

    def lines(self, cache: SlotCache, model) -> list[str]:
        def rate(n, s):
            return f"{n / s:.2f} tok/s" if s > 0 and n else "n/a"

        kinds = cache.bytes_by_kind()
        fed = self.prompt_tokens - self.reused_tokens
        return [
            f"load: {self.load_seconds:.2f} s (file opened and checked {self.load_parts[0]:.2f} s, weights "
            f"{self.load_parts[1]:.2f} s, tokenizer built meanwhile, then waited for {self.load_parts[2]:.2f} s)",
            f"prompt: {self.prompt_tokens} tokens ({self.reused_tokens} reused), {fed} in {self.prompt_seconds:.3f} s, "
            f"{rate(fed, self.prompt_seconds)}; first token {self.first_token_seconds:.3f} s after the prompt arrived",
            f"generation: {self.generated_tokens} tokens, {rate(self.generated_tokens, self.generation_seconds)}"
            f" (stopped by {self.stopped_by})",
            f"peak memory: {mx.get_peak_memory() / 1e9:.3f} GB; weights {model.weight_bytes:,} bytes on the "
            f"{model.path} path",
            f"KV cache: {cache.nbytes:,} bytes allocated for {cache.context:,} positions "
            f"(sliding rings {kinds['sliding']:,}, full planes {kinds['full']:,})",
        ]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m muse_mlx.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="path to a muse-glimmer GGUF (default: the embedded synthetic fixture, "
                                   "written to the cache on first use)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="prompt text, or '-' to read stdin")
    prompt.add_argument("--file", "-f", metavar="FILE", help="read the prompt from a file (llama.cpp's -f)")
    p.add_argument("--max-tokens", "-m", type=int, default=100, help="maximum tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p_max (0: off)")
    p.add_argument("--typical", "--typical-p", type=float, default=1.0,
                   help="keep the locally typical tokens up to this mass (llama.cpp's; 1: off)")
    p.add_argument("--top-n-sigma", "--top-nsigma", type=float, default=-1.0,
                   help="keep the logits within n standard deviations of the best (llama.cpp's; <= 0: off)")
    p.add_argument("--xtc-probability", type=float, default=0.0,
                   help="XTC: the chance a pick drops the likely tokens but the least likely of them (llama.cpp's; 0: off)")
    p.add_argument("--xtc-threshold", type=float, default=0.1,
                   help="XTC: the probability from which a token is likely (llama.cpp's; over 0.5: off)")
    p.add_argument("--dynatemp-range", type=float, default=0.0,
                   help="dynamic temperature: --temp -/+ this by the candidates' entropy (llama.cpp's; 0: off)")
    p.add_argument("--dynatemp-exp", type=float, default=1.0, help="dynamic temperature's exponent (llama.cpp's)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="divide a recent token's logit by this (multiply where <= 0), as llama.cpp (1: off)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="the last tokens of prompt and output the penalties look back over (0: off; default 64)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="take this off a recent token's logit (0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="take this times its count off a recent token's logit (0: off)")
    p.add_argument("--dry-multiplier", type=float, default=0.0,
                   help="DRY: a token extending a repeat loses this * base^(length - allowed length) (llama.cpp's; 0: off)")
    p.add_argument("--dry-base", type=float, default=1.75,
                   help="DRY's base (llama.cpp's; default 1.75; a value under 1 keeps the default)")
    p.add_argument("--dry-allowed-length", type=int, default=2, help="DRY: repeats this long go unpenalized (default 2)")
    p.add_argument("--dry-penalty-last-n", type=int, default=64,
                   help="DRY: the last tokens of prompt and output it looks back over (0: off; default 64)")
    p.add_argument("--dry-sequence-breaker", action="append", metavar="TEXT",
                   help="DRY: a text no repeat reaches back past; repeatable, replacing the defaults (newline, ':', "
                        "'\"', '*'); 'none': no breakers (llama.cpp's)")
    p.add_argument("--mirostat", type=int, default=0, choices=(0, 1, 2),
                   help="Mirostat 1 or 2 in place of the penalties, DRY and the filters (llama.cpp's; 0: off)")
    p.add_argument("--mirostat-lr", type=float, default=0.1, help="Mirostat's learning rate eta (default 0.1)")
    p.add_argument("--mirostat-ent", type=float, default=5.0, help="Mirostat's target surprise tau (default 5.0)")
    p.add_argument("--adaptive-target", type=float, default=-1.0,
                   help="adaptive-p: draw tokens near this probability, where --samplers names adaptive_p "
                        "(llama.cpp's; negative: as they are)")
    p.add_argument("--adaptive-decay", type=float, default=0.9, help="adaptive-p's moving average decay (default 0.9)")
    p.add_argument("--min-keep", type=int, default=0,
                   help="typical-p, top-p and min-p keep at least this many tokens, XTC leaves as many (llama.cpp's)")
    add_samplers_flags(p)
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID(+/-)BIAS",
                   help="add BIAS to a token's logit, as llama.cpp takes it (e.g. 15043+1, 15043-inf); repeatable")
    p.add_argument("--ignore-eos", action="store_true",
                   help="sample the end-of-generation tokens as any other: always --max-tokens (llama.cpp's flag)")
    grammar = p.add_mutually_exclusive_group()
    grammar.add_argument("--grammar", metavar="GBNF", help="constrain the output to this grammar (llama.cpp's GBNF)")
    grammar.add_argument("--grammar-file", metavar="FILE", help="--grammar, read from a file")
    grammar.add_argument("--json-schema", "-j", metavar="SCHEMA",
                         help="constrain the output to JSON this schema accepts (e.g. '{}' for any JSON value)")
    grammar.add_argument("--json-schema-file", "-jf", metavar="FILE", help="--json-schema, read from a file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system-prompt", help="system message for --chat")
    p.add_argument("--chat-template-kwargs", metavar="JSON",
                   help="the chat template's own variables as a JSON object, e.g. '{\"reasoning_strength\": \"low\"}' "
                        "(llama.cpp's flag)")
    p.add_argument("--chat-template-file", metavar="FILE",
                   help="a Jinja chat template for --chat in place of the GGUF's (llama.cpp's flag)")
    p.add_argument("--reasoning-format", choices=("none", "auto", "deepseek", "deepseek-legacy"),
                   help="with --chat and muse-glimmer's template, the answer is read as llama-cli reads it: its "
                        "reasoning shown between [Start thinking] and [End thinking], then its content (auto, the "
                        "default, deepseek, deepseek-legacy), or the raw text with the format's markup (none)")
    p.add_argument("--max-context", type=int, help="slot context in positions (default: the model's limit)")
    p.add_argument("--reference", action="store_true",
                   help="use the MLX-ops reference path even on a GPU (the exactness path)")
    p.add_argument("--kernel-config", default="",
                   help="GPU kernel values, name=value,... (muse_mlx.config.KernelConfig; e.g. prefill_f16=0 for the "
                        "float32 prefill lane)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="decode as a --batch-invariant server does, so that its slots' output can be compared with "
                        "this run's bit for bit (KernelConfig.batch_invariant)")
    p.add_argument("--kernel-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the GPU kernels into MLX's disk cache, so that the next run loads them instead of "
                        "compiling them (CUDA; default on)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--prompt-cache", metavar="DIR", nargs="?", const="",
                    help="reuse the longest stored prefix of the prompt and store this prompt's checkpoints "
                         "(a folder of kvpacks, default $XDG_CACHE_HOME/muse_mlx/prompts; warm output equals cold "
                         "output bit for bit)")
    kv.add_argument("--load-kv", metavar="PACK", help="start from this kvpack (its tokens must begin the prompt)")
    p.add_argument("--save-kv", metavar="PACK",
                   help="write the prompt's KV as a kvpack, at the last multiple of 512 positions before the "
                        "prompt's last token (so that --load-kv reproduces this run bit for bit)")
    p.add_argument("--prompt-cache-bytes", type=int, default=16 * 2**30,
                   help="the prompt cache's byte budget, least recently used entries evicted (default 16 GiB)")
    return p


PROMPT_FILE_MAX_BYTES = 64 * 2**20


def _prompt_file(path: str) -> bytes:
    """--file's bytes (a regular file of at most PROMPT_FILE_MAX_BYTES), read before the weights load."""
    return cli.read_flag_file("--file", path, PROMPT_FILE_MAX_BYTES)


def _read_prompt(arg: str, data: bytes | None = None) -> str:
    """The prompt text, or stdin's bytes for '-', or a file's `data` (--file); as strict UTF-8 (Python
    hands argv's undecodable bytes over as lone surrogates: os.fsencode gives the bytes back)."""
    if data is None:
        data = os.fsencode(arg) if arg != "-" else sys.stdin.buffer.read() if sys.stdin is not None else b""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = "--file" if arg is None else "stdin" if arg == "-" else "--prompt"
        raise MuseError(f"{where} is not UTF-8 text: byte {exc.start} ({data[exc.start]:#04x}) cannot be decoded") \
            from None


def _logit_bias(text: str) -> tuple[int, float]:
    """llama.cpp's --logit-bias: TOKEN_ID then a signed bias ('15043+1', '15043-inf')."""
    import re

    m = re.fullmatch(r"(\d+)([+-](?:inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?))", text.strip())
    if m is None:
        raise MuseError(f"--logit-bias: expected TOKEN_ID(+/-)BIAS (e.g. 15043+1 or 15043-inf), got {text!r}")
    return int(m.group(1)), float(m.group(2))


def _template_kwargs(text: str | None) -> dict:
    """--chat-template-kwargs: a JSON object of the template's variables (not `messages` or
    `add_generation_prompt`, which the run gives)."""
    if text is None:
        return {}
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise MuseError(f"--chat-template-kwargs is not JSON: {exc}") from None
    except RecursionError:
        raise MuseError("--chat-template-kwargs nests too deeply") from None
    if not isinstance(value, dict):
        raise MuseError("--chat-template-kwargs must be a JSON object of the template's variables")
    taken = sorted(set(value) & {"messages", "add_generation_prompt"})
    if taken:
        raise MuseError(f"--chat-template-kwargs may not set {taken[0]!r}: the run gives it")
    return value


def _grammar_text(args) -> tuple[str, str, str] | None:
    """(kind, text, flag) of the grammar asked for, read from its file where one is named."""
    from .grammar import MAX_GRAMMAR_BYTES

    for flag, kind, is_file in (("--grammar", "gbnf", False), ("--grammar-file", "gbnf", True),
                                ("--json-schema", "json_schema", False), ("--json-schema-file", "json_schema", True)):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        if not is_file:
            return kind, value, flag
        data = cli.read_flag_file(flag, value, MAX_GRAMMAR_BYTES)
        try:
            return kind, data.decode("utf-8"), flag
        except UnicodeDecodeError as exc:
            raise MuseError(f"{flag} {value}: not UTF-8 (byte {exc.start})") from None
    return None


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = SamplerSettings(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                               typical_p=args.typical, top_n_sigma=args.top_n_sigma,
                               xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
                               dynatemp_range=args.dynatemp_range, dynatemp_exponent=args.dynatemp_exp,
                               seed=args.seed, repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                               presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                               logit_bias=tuple(_logit_bias(b) for b in args.logit_bias),
                               dry_multiplier=args.dry_multiplier, dry_base=args.dry_base if args.dry_base >= 1 else 1.75,
                               dry_allowed_length=args.dry_allowed_length, dry_penalty_last_n=args.dry_penalty_last_n,
                               dry_sequence_breakers=breakers_of_flags(args.dry_sequence_breaker),
                               mirostat=args.mirostat, mirostat_tau=args.mirostat_ent, mirostat_eta=args.mirostat_lr,
                               samplers=samplers_flags(args) or DEFAULT_SAMPLERS,
                               adaptive_target=args.adaptive_target, adaptive_decay=args.adaptive_decay,
                               min_keep=args.min_keep)
    problems = settings.problems()
    if args.max_tokens < 0:
        problems.append(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if args.max_context is not None and args.max_context < 1:
        problems.append(f"--max-context must be >= 1, got {args.max_context}")
    if args.system_prompt is not None and not args.chat:
        problems.append("--system-prompt needs --chat")
    if args.chat_template_file is not None and not args.chat:
        problems.append("--chat-template-file needs --chat")
    if args.reasoning_format is not None and not args.chat:
        problems.append("--reasoning-format needs --chat")
    template_kwargs = _template_kwargs(args.chat_template_kwargs)
    if template_kwargs and not args.chat:
        problems.append("--chat-template-kwargs needs --chat")
    if args.prompt_cache_bytes < 0:
        problems.append(f"--prompt-cache-bytes must be >= 0, got {args.prompt_cache_bytes}")
    if problems:
        raise MuseError(problems[0])
    kernel_config = KernelConfig.parse(args.kernel_config, args.batch_invariant)
    prompt_file = _prompt_file(args.file) if args.file is not None else None   # read before the weights load
    grammar = _grammar_text(args)
    if grammar is not None:   # checked before the weights load: a bad one fails now
        from .grammar import grammar_of
        grammar_of(*grammar)
    template = None
    if args.chat_template_file is not None:   # read and compiled before the weights load: a bad one fails now
        from .tokenizer import compile_chat_template, read_chat_template_file
        template = read_chat_template_file(args.chat_template_file)
        compile_chat_template(*template)

    from .default_model import default_model_path
    from .model import load
    from .tokenizer import MuseTokenizer

    t_load = time.perf_counter()
    model_path = args.model if args.model is not None else default_model_path()
    with ThreadPoolExecutor(max_workers=1) as pool:   # the tokenizer is built while the weights load
        building = []
        model = load(model_path, backend="reference" if args.reference else "auto", kernel_config=kernel_config,
                     progress=progress_bar("load", "layer"), kernel_cache=args.kernel_cache,
                     on_open=lambda a: building.append(pool.submit(lambda: MuseTokenizer(a.vocabulary, template))))
        t_tokenizer = time.perf_counter()
        tokenizer = building[0].result() if building else MuseTokenizer(model.artifact.vocabulary, template)
    g = model.geometry
    context = args.max_context or g.context_length
    if context > g.context_length:
        raise MuseError(f"--max-context {context} exceeds the model's context length {g.context_length}")
    opened = getattr(model, "open_seconds", 0.0)
    load_parts = (opened, t_tokenizer - t_load - opened, time.perf_counter() - t_tokenizer)

    prompt = _read_prompt(None, prompt_file) if args.file is not None else _read_prompt(args.prompt)
    if args.chat:
        messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else []) + \
            [{"role": "user", "content": prompt}]
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, **template_kwargs), add_bos=False)
    else:
        prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise MuseError("the prompt is empty (and the model adds no BOS token)")
    if len(prompt_ids) > context:
        raise ContextLimitError(f"the prompt is {len(prompt_ids)} tokens, longer than the context of {context} "
                                f"positions (--max-context)")

    too_big = [t for t, _ in settings.logit_bias if t >= g.n_vocab]
    if too_big:
        raise MuseError(f"--logit-bias: token {too_big[0]} is not in the model's vocabulary of {g.n_vocab:,}")
    streamer, display = _answer_reading(tokenizer, args)
    constraint = None
    if grammar is not None:
        from .grammar import Grammars
        grammars = Grammars(tokenizer)
        if display is not None and grammar[0] == "json_schema":   # as llama-server holds a chat's schema
            from . import chat_format
            grammar = ("lark", chat_format.answer_grammar(grammar[1], grammars.special_id), grammar[2])
        constraint = grammars.compile(*grammar)
    sampler = Sampler(settings, prompt_ids, tokenizer.vocab.suppress_ids, constraint,
                      tokenizer.dry_breakers(settings.dry_sequence_breakers) if settings.dry else None)
    stats = Stats(load_seconds=time.perf_counter() - t_load, load_parts=load_parts, prompt_tokens=len(prompt_ids))
    out = sys.stdout
    start = time.perf_counter()
    cache, logits, stats.reused_tokens = prefill(model, model_path, prompt_ids, context, args)
    stats.prompt_seconds = time.perf_counter() - start
    first = None
    stop_ids = frozenset() if args.ignore_eos else tokenizer.stop_ids
    for token in decode_tokens(model, cache, logits[-1], sampler, args.max_tokens, stop_ids):
        if first is None:
            first = time.perf_counter()
        stats.generated_tokens += 1
        out.write(display.push(streamer.push(token)) if display else streamer.push(token))
        out.flush()
    end = time.perf_counter()
    out.write(display.push(streamer.flush()) + display.close() if display else streamer.flush() + "\n")
    out.flush()
    stats.first_token_seconds = (first or end) - start
    stats.generation_seconds = end - first if first else 0.0
    if stats.generated_tokens < args.max_tokens:
        stats.stopped_by = "context limit" if cache.room == 0 else \
            "the grammar's end" if constraint is not None and constraint.done else "stop token"
    for line in stats.lines(cache, model):
        print(line, file=sys.stderr)
    return 0


def _answer_reading(tokenizer, args):
    """(the text streamer, the answer's display or None): with --chat and muse-glimmer's template the
    answer's markup is rendered (as llama-server's preserved tokens) and read as llama-cli shows it
    (chat_format.AnswerDisplay); else the text as it comes."""
    from . import chat_format

    if not args.chat or not chat_format.is_muse_glimmer(tokenizer.chat_template):
        return tokenizer.streamer(), None
    shown = tokenizer.token_ids(chat_format.PRESERVED) & tokenizer.control_ids   # a stop token's too (--ignore-eos)
    fmt = chat_format.ChatFormat(reasoning=(args.reasoning_format or "auto") != "none")
    return tokenizer.streamer(shown), chat_format.AnswerDisplay(fmt)


def progress_bar(desc: str, unit: str):
    """A tqdm bar on stderr as a progress(done, total) callback, or None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return update


def prefill(model, model_path, prompt_ids: list[int], context: int, args):
    """The prompt into a new slot: cold, from a kvpack (--load-kv) or the prompt cache; and
    --save-kv. Returns (cache, logits of the prompt's last token, prompt tokens reused). Reports
    reuse on stderr; a progress bar while a long prompt prefills on a terminal."""
    bar = progress_bar("prompt", "tok") if len(prompt_ids) > PREFILL_CHUNK else None
    from . import kvpack
    from .prompt_cache import PromptCache

    g = model.geometry
    model_id = None
    if args.load_kv or args.save_kv or args.prompt_cache is not None:
        from .tools.fixtures import cache_dir

        model_id = {"fingerprint": kvpack.fingerprint(model_path, cache_dir()), "architecture": "muse-glimmer"}
    if args.load_kv:
        t = time.perf_counter()
        cache, tokens = kvpack.restore(args.load_kv, g, model_id["fingerprint"], context, upload=model.ops.upload)
        if len(tokens) >= len(prompt_ids) or prompt_ids[:len(tokens)] != tokens:
            raise MuseError(f"{args.load_kv}: its {len(tokens)} tokens are not a proper prefix of the prompt's "
                            f"{len(prompt_ids)}")
        print(f"kv: restored {len(tokens)} of {len(prompt_ids)} prompt tokens from {args.load_kv} in "
              f"{time.perf_counter() - t:.3f} s", file=sys.stderr)
    else:
        cache, tokens = None, []
    if args.prompt_cache is not None:
        pc = PromptCache(args.prompt_cache or cache_dir() / "prompts", model_id, g,
                         budget_bytes=args.prompt_cache_bytes, upload=model.ops.upload)
        hit = pc.lookup(prompt_ids, context)
        print(f"prompt cache: reused {hit.reused} of {len(prompt_ids)} prompt tokens"
              + (f" (restore {hit.seconds:.3f} s)" if hit.reused else "")
              + (", with the last token's logits: nothing to prefill" if hit.logits is not None else ""),
              file=sys.stderr)
        if hit.logits is not None:
            return hit.cache, mx.array(hit.logits).reshape(1, -1), hit.reused
        cache = hit.cache or model.make_cache(context)
        progress = None if bar is None else (lambda d, n: bar(hit.reused + d, len(prompt_ids)))
        return cache, pc.prefill(model, prompt_ids, cache, hit.reused, progress=progress), hit.reused
    cache = cache or model.make_cache(context)
    reused = start = len(tokens)

    def done(a: int):
        return None if bar is None else (lambda d, n: bar(a + d, len(prompt_ids)))
    if args.save_kv:
        point = max(start, (len(prompt_ids) - 1) // PREFILL_CHUNK * PREFILL_CHUNK)
        if point > start:
            model.prefill(prompt_ids[start:point], cache, progress=done(start))
        kvpack.save(cache, prompt_ids[:point], model_id, args.save_kv)
        start = point
    return cache, model.prefill(prompt_ids[start:], cache, progress=done(start)), reused


def main(argv: list[str] | None = None) -> int:
    return cli.run(run, argv)


if __name__ == "__main__":
    cli.exit_now(main())   # the interpreter's and MLX's teardown skipped: ~0.15 s of a short run (ledger)
