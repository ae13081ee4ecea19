"""Serving benchmarks on the GPU: warm prefix reuse through kvpack (issue 15) and the packed decode
step over 1..4 slots (issue 16), with a receipt.

- warm: for a prompt of L tokens whose deepest stored checkpoint is at C = the last multiple of
  512 below L (prompt_cache.py's rule), the time to the first token when the pack is restored
  from disk and only L - C tokens are prefilled, against the cold prefill of all L (for
  L <= --cold-max), and the same prompt repeated: its exact end restored with its last logits
  (prompt_cache's store_end), nothing prefilled. Also the pack's save and restore rates
  (restored once with its blobs dropped from the page cache, once from it) against the disk's
  own write / read and a host copy of the same bytes, and the model fingerprint's first
  computation (kvpack.fingerprint).
- batch: aggregate greedy tokens per second of the forward over B sequences x 1 token (the step the
  server's slots share), at a depth, pipelined as generate's loop is.
- matvec rows: one step's matrix products alone (every raw matrix of the model, as launched;
  the FFN down product through plain matvec, not its silu form) for B rows of x, under each of
  --matvec-configs: the products' share of a packed step, and how a kernel setting moves it.
- scheduler: the server's engine loop itself (slots.Scheduler, pipelined, no HTTP) with N slots and
  N requests of --sched-prompt random ids and --sched-tokens greedy tokens submitted at once, as
  llama-batched-bench -npp 512 -ntg 128 -npl N: each request's time to its first token, and the
  aggregate decode rate once all have one. A request that samples a stop id ends early (its
  tokens counted as they came). --sched-constraint gives every request a grammar: `lazy`, the
  muse-glimmer tool-call grammar a request with tools gets (held from llama.cpp's trigger on; the
  random weights never write it, so this is the cost of a grammar waiting), or `text`, a GBNF of
  lowercase words held from the first token (each pick masked on the host); `dry` gives each
  request llama.cpp's DRY penalty instead (multiplier 0.8, its defaults otherwise), which reads each
  token on the host as a grammar does.

The K/V rows are random f16 (SlotCache.fill_random): timing depends on sizes, not values; the
numbers are as synthetic as the GGUF they run on.

    python -m muse_mlx.tools.bench_serving --model X.gguf [--warm 2048,32768,65536] [--cold-max 2048]
        [--cold-reps 2] [--batch 1,2,3,4] [--depth 0] [--decode-tokens 48] [--workdir DIR] [--receipt OUT.json]
        [--kernel-config stream_batch=0,...] [--matvec-rows 1,2,3,4 --matvec-configs "tag:cfg;tag:cfg"]
        [--scheduler 1,2,3,4 --sched-prompt 512 --sched-tokens 128]
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import cli
from ..cli import Parser, ints
from ..config import KernelConfig
from ..errors import MuseError
from ..geometry import PREFILL_CHUNK
from .bench import _stats


def _drop_from_page_cache(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_rates(folder: Path, nbytes: int) -> dict:
    """Write (with fsync) and read back (dropped from the page cache first) one file of nbytes, and
    copy the same bytes in host memory: GB/s each."""
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    path = folder / "disk-probe.bin"
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t
    _drop_from_page_cache(folder)
    t = time.perf_counter()
    back = np.fromfile(path, dtype=np.uint8)
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    copy = data.copy()
    copy_s = time.perf_counter() - t
    assert back.size == copy.size == nbytes
    path.unlink()
    return {"bytes": nbytes, "write_gbps": nbytes / write_s / 1e9, "read_gbps": nbytes / read_s / 1e9,
            "host_copy_gbps": nbytes / copy_s / 1e9}


def warm_cell(model, model_id: dict, length: int, cold: bool, workdir: Path, cold_reps: int = 2) -> dict:
    from .. import kvpack

    g = model.geometry
    tokens = np.random.default_rng(length).integers(0, g.n_vocab, length).tolist()
    ckpt = (length - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    cache = model.make_cache(length + 1)
    cache.fill_random(ckpt)
    pack_dir = workdir / f"pack-{length}"
    t = time.perf_counter()
    kvpack.save(cache, tokens[:ckpt], model_id, pack_dir)
    save_s = time.perf_counter() - t
    payload = kvpack.payload_bytes(kvpack.read_manifest(pack_dir).manifest)
    del cache
    out = {"length": length, "checkpoint": ckpt, "prefilled_after_restore": length - ckpt,
           "pack_payload_bytes": payload, "save_s": save_s, "save_gbps": payload / save_s / 1e9}

    def warm_once() -> tuple[float, float]:
        t0 = time.perf_counter()
        restored, _ = kvpack.restore(pack_dir, g, model_id["fingerprint"], length + 1, upload=model.ops.upload)
        mx.eval(restored.state())
        t1 = time.perf_counter()
        first = mx.argmax(model.prefill(tokens[ckpt:], restored))
        mx.eval(first)
        return t1 - t0, time.perf_counter() - t0

    _drop_from_page_cache(pack_dir)
    out["restore_from_disk_s"], out["warm_ttft_from_disk_s"] = warm_once()
    samples = [warm_once() for _ in range(3)]
    out["restore_s"] = _stats([s[0] for s in samples])
    out["warm_ttft_s"] = _stats([s[1] for s in samples])
    out["restore_gbps"] = payload / out["restore_s"]["mean"] / 1e9
    out["restore_from_disk_gbps"] = payload / out["restore_from_disk_s"] / 1e9
    # the same prompt again: its exact end stored with its last token's logits (prompt_cache's
    # store_end), so the first token is the stored logits' argmax once the cache is restored
    end_dir = workdir / f"end-{length}"
    cache = model.make_cache(length + 1)
    cache.fill_random(length)
    last = np.random.default_rng(1).standard_normal(g.n_vocab).astype(np.float32)
    kvpack.save(cache, tokens, model_id, end_dir, last_logits=last)
    del cache

    def end_once() -> float:
        t0 = time.perf_counter()
        pack = kvpack.read_manifest(end_dir)
        logits = kvpack.read_last_logits(pack)
        restored, _ = kvpack.restore(pack, g, model_id["fingerprint"], length + 1, upload=model.ops.upload)
        mx.eval(restored.state())
        int(np.argmax(logits))
        return time.perf_counter() - t0

    _drop_from_page_cache(end_dir)
    out["repeat_ttft_from_disk_s"] = end_once()
    out["repeat_ttft_s"] = _stats([end_once() for _ in range(3)])
    shutil.rmtree(end_dir)
    if cold:
        def cold_once() -> float:
            c = model.make_cache(length + 1)
            t0 = time.perf_counter()
            mx.eval(mx.argmax(model.prefill(tokens, c)))
            return time.perf_counter() - t0
        if length <= 4 * PREFILL_CHUNK:   # a short prompt's first run warms; a long one's chunks were traced before
            cold_once()
        out["cold_ttft_s"] = _stats([cold_once() for _ in range(cold_reps)])
    shutil.rmtree(pack_dir)
    return out


def _host_counters() -> dict:
    """The host's side of a timed window: this process's CPU seconds (all threads) and the
    machine's stolen CPU seconds (/proc/stat's steal: time a virtual machine's CPUs waited for the
    hypervisor; absent where the file is)."""
    out = {"process_cpu_s": time.process_time()}
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        out["steal_s"] = int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        pass
    return out


def _host_delta(start: dict, end: dict) -> dict:
    return {k: round(end[k] - start[k], 4) for k in start if k in end}


def batch_cell(model, batch: int, depth: int, tokens: int, reps: int = 3) -> dict:
    """The packed step alone: `batch` sequences at `depth` random rows, `tokens` greedy steps,
    pipelined. Per repetition also the host's part: the seconds spent building and submitting the
    steps (the model call and async_eval), the process's CPU seconds and the machine's stolen ones."""
    caches = [model.make_cache(depth + (reps + 1) * (tokens + 8) + 8) for _ in range(batch)]
    hosts: list[dict] = []

    def once() -> float:
        for c in caches:
            c.fill_random(depth)
        tok = mx.zeros((batch, 1), dtype=mx.int32)
        mx.eval(tok)
        counters = _host_counters()
        built = 0.0
        t = time.perf_counter()
        for _ in range(tokens):
            b = time.perf_counter()
            tok = mx.argmax(model(tok, caches)[:, -1], axis=-1).astype(mx.int32).reshape(batch, 1)
            mx.async_eval(tok)
            built += time.perf_counter() - b
        mx.eval(tok)
        wall = time.perf_counter() - t
        host = {"build_submit_ms_per_step": round(built / tokens * 1e3, 3), **_host_delta(counters, _host_counters())}
        synced = []   # a few steps with a wait after each: the host's build alone, then what the GPU had left
        for _ in range(8):
            b = time.perf_counter()
            tok = mx.argmax(model(tok, caches)[:, -1], axis=-1).astype(mx.int32).reshape(batch, 1)
            mx.async_eval(tok)
            m = time.perf_counter()
            mx.eval(tok)
            synced.append((m - b, time.perf_counter() - m))
        host["synced_build_ms"] = round(float(np.median([x[0] for x in synced])) * 1e3, 3)
        host["synced_wait_ms"] = round(float(np.median([x[1] for x in synced])) * 1e3, 3)
        hosts.append(host)
        return batch * tokens / wall

    once()
    hosts.clear()
    agg = _stats([once() for _ in range(reps)])
    return {"batch": batch, "depth": depth, "tokens_per_sequence": tokens, "aggregate_tok_s": agg,
            "per_sequence_tok_s": agg["mean"] / batch, "host": hosts}


def _mlx_memory() -> dict:
    """MLX's allocator: MB active, held in its cache, and the peak so far."""
    return {"active": round(mx.get_active_memory() / 2**20, 1), "cache": round(mx.get_cache_memory() / 2**20, 1),
            "peak": round(mx.get_peak_memory() / 2**20, 1)}


# --sched-constraint: a never-ending text grammar (every pick masked), and the tools a lazy one holds
CONSTRAINT_TEXT = 'root ::= [a-z]+ (" " [a-z]+)*'
CONSTRAINT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def constraint_maker(kind: str, tokenizer):
    """A callable giving each request its own constraint of this --sched-constraint kind, or None."""
    if kind in ("none", "dry"):
        return None
    from .. import chat_format
    from ..grammar import Grammars

    grammars = Grammars(tokenizer)
    if kind == "text":
        return lambda: grammars.compile("gbnf", CONSTRAINT_TEXT, "the text grammar")
    fmt, _ = chat_format.read_format({"tools": CONSTRAINT_TOOLS})
    text = chat_format.tools_grammar(fmt, grammars.special_id)
    return lambda: grammars.lazy("lark", text, "the tools' grammar", chat_format.TRIGGER, ">")


def scheduler_cell(model, tokenizer, slots: int, prompt: int, tokens: int, reps: int = 2,
                   constraint=None, dry: bool = False) -> dict:
    """The server's engine loop (slots.Scheduler, no HTTP) with `slots` slots: as many requests of
    `prompt` random token ids and `tokens` greedy tokens, submitted at once (llama-batched-bench's
    -npp prompt -ntg tokens -npl slots). Per repetition: each request's time to its first token
    from the submission, the aggregate decode rate once every request has its first token
    (tokens after that moment over the time to the last one), the gaps between the first
    request's tokens (median, the largest and at which tokens, how many over twice the median),
    Python's garbage collections meanwhile (count and pause by generation) and MLX's memory
    (active, cached, peak) at its start and end: what a slow repetition was made of. constraint: a
    callable giving each request its grammar (constraint_maker), or None; dry: each request with
    llama.cpp's DRY penalty (multiplier 0.8)."""
    import gc
    import threading

    from ..sampling import SamplerSettings
    from ..slots import Request, Scheduler

    sched = Scheduler(model, tokenizer, slots, prompt + tokens + 8)
    sched.thread.start()

    def once(seed: int) -> dict:
        times: list[list[float]] = [[] for _ in range(slots)]
        done = [threading.Event() for _ in range(slots)]
        pauses: dict[int, list[float]] = {}
        began = [0.0]

        def on_gc(phase, info):
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                pauses.setdefault(info["generation"], []).append(time.perf_counter() - began[0])
        gc.callbacks.append(on_gc)
        memory_at_start = _mlx_memory()
        counters = _host_counters()
        t0 = time.perf_counter()
        for i in range(slots):
            ids = np.random.default_rng(seed * 16 + i).integers(0, model.geometry.n_vocab, prompt).tolist()

            def emit(e, i=i):
                if "token" in e:
                    times[i].append(time.perf_counter())
                if "finish_reason" in e or "error" in e:
                    done[i].set()
            sched.submit(Request(ids, tokens, SamplerSettings(dry_multiplier=0.8 if dry else 0.0), emit,
                                 constraint=constraint() if constraint is not None else None))
        for d in done:
            d.wait()
        gc.callbacks.remove(on_gc)
        end = max(t[-1] for t in times if t)
        first = max(t[0] for t in times if t)
        after = sum(1 for t in times for x in t if x > first)
        gaps = np.diff(times[0]) * 1e3 if len(times[0]) > 2 else np.zeros(1)
        median = float(np.median(gaps))
        run = {"ttft_s": [t[0] - t0 if t else None for t in times], "generated": [len(t) for t in times],
               "aggregate_tok_s": after / (end - first) if end > first else None, "wall_s": end - t0,
               "compiled_steps": len(getattr(model, "_compiled", {})),   # traces so far (each B and split key)
               "token_gaps_ms": {"median": median, "max": float(gaps.max()),
                                 "over_twice_median": int((gaps > 2 * median).sum()),
                                 "largest": [round(float(x), 3) for x in np.sort(gaps)[-5:][::-1]],
                                 "largest_at": [int(i) + 1 for i in np.argsort(gaps)[-5:][::-1]]},   # token index
               "mlx_memory_mb": {"at_start": memory_at_start, "at_end": _mlx_memory()},
               "host": _host_delta(counters, _host_counters()),
               "gc": {str(gen): {"collections": len(p), "pause_ms": round(sum(p) * 1e3, 3),
                                 "max_pause_ms": round(max(p, default=0.0) * 1e3, 3)}
                      for gen, p in sorted(pauses.items())}}
        gaps = run["token_gaps_ms"]
        print(f"  engine loop, {slots} slot(s), run {seed}: {run['wall_s']:.2f} s, {run['compiled_steps']} compiled "
              f"steps so far; token gaps median {gaps['median']:.2f} ms, largest {gaps['largest']} at tokens "
              f"{gaps['largest_at']}; host {run['host']}; gc {run['gc']}; MLX memory MB {run['mlx_memory_mb']}",
              file=sys.stderr, flush=True)
        return run

    try:
        once(0)   # every shape's kernels and graphs built
        runs = [once(r + 1) for r in range(reps)]
    finally:
        sched.stop()
        sched.thread.join(60)
    agg = [r["aggregate_tok_s"] for r in runs if r["aggregate_tok_s"]]
    ttft = [x for r in runs for x in r["ttft_s"] if x is not None]
    return {"slots": slots, "prompt": prompt, "tokens": tokens, "runs": runs,
            "aggregate_tok_s": _stats(agg) if agg else None, "ttft_s": _stats(ttft) if ttft else None}


def matvec_rows_cell(model, rows: list[int], configs: list[tuple[str, KernelConfig]], tokens: int = 16,
                     reps: int = 3) -> list[dict]:
    """Per kernel configuration and row count B: milliseconds of one step's matrix products alone
    (model.matrices(), each through Kernels.matvec with B rows of x), `tokens` steps pipelined."""
    from ..kernels import Kernels

    mats = [m for m in model.matrices() if m.raw]
    out = []
    for tag, config in configs:
        kernels = Kernels(model.ops.kernels.device, config)
        for b in rows:
            xs = {m.n_in: mx.random.normal((b, m.n_in)) for m in mats}
            mx.eval(list(xs.values()))

            def once() -> float:
                t = time.perf_counter()
                for _ in range(tokens):
                    ys = [kernels.matvec(m.data, m.qtype, xs[m.n_in]) for m in mats]
                    mx.async_eval(ys)
                mx.eval(ys)
                return (time.perf_counter() - t) * 1e3 / tokens

            once()
            cell = {"config": tag, "kernel_config": dataclasses.asdict(config), "rows": b,
                    "products": len(mats), "ms": _stats([once() for _ in range(reps)])}
            out.append(cell)
            print(f"matvecs [{tag}] {b} row(s): {cell['ms']['mean']:.3f} ms a step (CV {cell['ms']['cv']:.2%})",
                  flush=True)
            del xs
            mx.clear_cache()
    return out


def _fingerprint(path: str, work: Path, metrics: dict) -> dict:
    """The model's kvpack identity, its first computation and a cached one timed into metrics."""
    from .. import kvpack

    t = time.perf_counter()
    fid = kvpack.fingerprint(path, work / "fingerprints")
    metrics["fingerprint_first_s"] = time.perf_counter() - t
    t = time.perf_counter()
    kvpack.fingerprint(path, work / "fingerprints")
    metrics["fingerprint_cached_s"] = time.perf_counter() - t
    metrics["file_bytes"] = Path(path).stat().st_size
    print(f"fingerprint: {metrics['fingerprint_first_s']:.2f} s first, {metrics['fingerprint_cached_s'] * 1e3:.1f} ms "
          f"cached ({metrics['file_bytes'] / 1e9:.2f} GB)", flush=True)
    return {"fingerprint": fid, "architecture": "muse-glimmer"}


def _command(argv=None) -> int:
    p = Parser(prog="python -m muse_mlx.tools.bench_serving", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a muse-glimmer GGUF")
    p.add_argument("--warm", default="2048,32768,65536", help="prompt lengths of the warm cells ('' for none)")
    p.add_argument("--cold-max", type=int, default=2048, help="also time the cold prefill up to this length")
    p.add_argument("--cold-reps", type=int, default=2, help="timed cold prefills a length (>= 1)")
    p.add_argument("--batch", default="1,2,3,4", help="slot counts of the packed-step cells ('' for none)")
    p.add_argument("--depth", type=int, default=0, help="K/V depth of each sequence in the batch cells")
    p.add_argument("--scheduler", default="", help="slot counts of the engine-loop cells (slots.Scheduler: N "
                   "requests at once, as llama-batched-bench -npl N; '' for none)")
    p.add_argument("--sched-prompt", type=int, default=512, help="prompt tokens of each engine-loop request")
    p.add_argument("--sched-tokens", type=int, default=128, help="greedy tokens of each engine-loop request")
    p.add_argument("--sched-reps", type=int, default=2, help="timed repetitions of each engine-loop cell (>= 1), "
                   "after one untimed")
    p.add_argument("--sched-constraint", choices=("none", "lazy", "text", "dry"), default="none",
                   help="a grammar on every engine-loop request: lazy (the tool-call grammar, from its trigger on) "
                        "or text (from the first token); or dry: llama.cpp's DRY penalty on each")
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--workdir", help="where packs are written (default: a temporary folder)")
    p.add_argument("--receipt")
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--reference", action="store_true", help="the MLX-ops backend (CPU smoke runs)")
    p.add_argument("--kernel-config", default="", help="kernel tuning values, name=value,... (config.KernelConfig)")
    p.add_argument("--matvec-rows", default="", help="row counts of the matvec cells ('' for none)")
    p.add_argument("--matvec-configs", default="default:",
                   help="kernel configurations of the matvec cells, 'tag:name=value,...;tag2:...'")
    args = p.parse_args(argv)
    kernel_config = KernelConfig.parse(args.kernel_config)
    warm, batches = ints(args.warm, "--warm"), ints(args.batch, "--batch")
    sched_slots = ints(args.scheduler, "--scheduler")
    if any(not 1 <= v <= 4 for v in sched_slots) or min(args.sched_prompt, args.sched_tokens, args.sched_reps) < 1:
        raise MuseError("--scheduler values must be 1..4 (the server's --parallel), --sched-prompt, "
                        "--sched-tokens and --sched-reps >= 1")
    matvec_rows = ints(args.matvec_rows, "--matvec-rows")
    matvec_configs = KernelConfig.parse_tagged(args.matvec_configs, "--matvec-configs")
    if any(v < 1 for v in warm + batches) or args.depth < 0 or args.decode_tokens < 1 or args.cold_reps < 1:
        raise MuseError("--warm and --batch values, --decode-tokens and --cold-reps must be >= 1, --depth >= 0")
    if any(not 1 <= v <= 8 for v in matvec_rows):
        raise MuseError(f"--matvec-rows values must be 1..8, got {args.matvec_rows!r}")
    if matvec_rows and args.reference:
        raise MuseError("--matvec-rows times the GPU kernels; the MLX-ops backend (--reference) has none")
    from ..model import load
    from .receipts import make_receipt, write_receipt

    t = time.perf_counter()
    model = load(args.model, backend="reference" if args.reference else "gpu", kernel_config=kernel_config)
    metrics = {"load_s": time.perf_counter() - t, "kernel_config": dataclasses.asdict(kernel_config), "warm": [],
               "batch": [], "matvec_rows": [], "scheduler": [],
               # MLX's own tuning variables as this process saw them (MLX reads them; the bench only reports them)
               "mlx_environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="muse-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model_id = {}
        if warm:   # the model's identity; the kernels and the chunk's graph built once, before any cell is timed
            model_id = _fingerprint(args.model, work, metrics)
            scratch = model.make_cache(PREFILL_CHUNK + 1)
            mx.eval(model.prefill(list(range(PREFILL_CHUNK)), scratch))
            del scratch
        for length in warm:
            cell = warm_cell(model, model_id, length, length <= args.cold_max, work, args.cold_reps)
            metrics["warm"].append(cell)
            cold = f", cold {cell['cold_ttft_s']['mean']:.3f} s" if "cold_ttft_s" in cell else ""
            print(f"warm {length:>6}: first token {cell['warm_ttft_s']['mean']:.3f} s (restore "
                  f"{cell['restore_s']['mean']:.3f} s = {cell['restore_gbps']:.2f} GB/s; from disk "
                  f"{cell['warm_ttft_from_disk_s']:.3f} s) + {cell['prefilled_after_restore']} tokens{cold}; save "
                  f"{cell['save_gbps']:.2f} GB/s of {cell['pack_payload_bytes'] / 1e9:.3f} GB; the prompt repeated: "
                  f"first token {cell['repeat_ttft_s']['mean']:.3f} s (from disk {cell['repeat_ttft_from_disk_s']:.3f} s)",
                  flush=True)
        if metrics["warm"]:
            metrics["disk"] = disk_rates(work, max(c["pack_payload_bytes"] for c in metrics["warm"]))
            print(f"disk: write {metrics['disk']['write_gbps']:.2f} GB/s, read {metrics['disk']['read_gbps']:.2f} "
                  f"GB/s, host copy {metrics['disk']['host_copy_gbps']:.2f} GB/s", flush=True)
        if matvec_rows:
            metrics["matvec_rows"] = matvec_rows_cell(model, matvec_rows, matvec_configs)
        for b in batches:
            cell = batch_cell(model, b, args.depth, args.decode_tokens)
            metrics["batch"].append(cell)
            print(f"batch {b}: {cell['aggregate_tok_s']['mean']:.1f} tok/s aggregate (CV "
                  f"{cell['aggregate_tok_s']['cv']:.2%}), {cell['per_sequence_tok_s']:.1f} per sequence; host "
                  f"{cell['host']}", flush=True)
        if sched_slots:
            from ..tokenizer import MuseTokenizer

            tokenizer = MuseTokenizer(model.artifact.vocabulary)
            constraint = constraint_maker(args.sched_constraint, tokenizer)
        for n in sched_slots:
            cell = scheduler_cell(model, tokenizer, n, args.sched_prompt, args.sched_tokens, args.sched_reps,
                                  constraint, args.sched_constraint == "dry")
            cell["constraint"] = args.sched_constraint
            metrics["scheduler"].append(cell)
            agg, ttft = cell["aggregate_tok_s"], cell["ttft_s"]
            print(f"engine loop, {n} slot(s): {agg['mean'] if agg else float('nan'):.1f} tok/s aggregate, first token "
                  f"{ttft['mean'] if ttft else float('nan'):.3f} s mean ({args.sched_prompt} + {args.sched_tokens} "
                  f"tokens each)", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    receipt = make_receipt("bench/serving", inputs=vars(args), metrics=metrics, synthetic=args.synthetic,
                           notes=["K/V rows random f16 (SlotCache.fill_random); the restore 'from disk' "
                                  "sample follows posix_fadvise(DONTNEED) on the pack's blobs"])
    if args.receipt:
        print(f"receipt: {write_receipt(args.receipt, receipt)}")
    return 0


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    cli.exit_now(main())   # the engine-loop cells ran MLX on the scheduler's thread (cli.exit_now)
