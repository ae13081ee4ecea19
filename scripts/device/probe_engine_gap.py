"""Where the engine loop's time over the packed step goes (issue 16: at 5be8c66 the server's engine
loop, slots.Scheduler, ran 4-8 % under the packed step, bench_serving --batch, at B = 1..4).

One process, one model, B caches of `--depth` random rows (SlotCache.fill_random), rewound to that
depth before every run; each variant decodes `--tokens` tokens for the B sequences, pipelined, and is
timed in turn, interleaved over `--reps` passes (tok/s aggregate: B x the forwards a variant ran, the first logits' included, over
its time):

  packed     argmax of the (B, vocab) logits, fed back lazily; nothing read until the end
             (bench_serving's batch cell)
  read1      the same, and after submitting step k+1 the host reads step k's B tokens (one
             array, one readback a step: the engine's sync alone)
  picks      per sequence the engine's own lazy picks (Sampler.token on its row, all_finite), fed
             back by one concatenate, read one scalar at a time with .item() (2B reads a step):
             slots.Scheduler._decode without its Python per token
  picks1     the same picks, stacked before the step is submitted into one (B, 2) int32 array
             read once a step
  picksT     picks, run in a thread of its own (as the Scheduler runs): MLX gives each thread
             its own default stream, while the model's weights and compiled steps were made on
             the main thread's
  decode     slots.Scheduler._decode itself on B slots around the same caches: the picks, the
             stream decoder, the stop matcher, an emit that does nothing (no stop ids, so no
             slot ends)
  decodeT    decode, in a thread of its own
  sched      the Scheduler as the server runs it: its thread's loop around _decode, the slots
             set up on that thread, each request ending after the tokens (one Scheduler a B)
  (the threaded variants run on one long-lived thread, as the server's: MLX keeps compiled
  steps per thread)
  (decode and decodeT also print and record their host timeline: per step, the time from building
  it to the first emit, which blocks on the step before, and the time between builds; a wait
  near zero marks a step the host set, not the GPU; sched records the time between builds and its
  run's time outside them)

Usage: python scripts/device/probe_engine_gap.py MODEL.gguf OUT.json [--batch 1,2,4] [--depth 512]
       [--tokens 64] [--reps 3] [--variants packed,decode,decodeT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from muse_mlx.artifact import open_artifact  # noqa: E402
from muse_mlx.model import Model  # noqa: E402
from muse_mlx.sampling import Sampler, SamplerSettings, all_finite  # noqa: E402
from muse_mlx.slots import Request, Scheduler, Slot, StopMatcher  # noqa: E402
from muse_mlx.tokenizer import MuseTokenizer  # noqa: E402
from muse_mlx.tools.receipts import make_receipt  # noqa: E402


def packed(model, caches, tokens, read_each):
    B = len(caches)
    tok = mx.zeros((B, 1), dtype=mx.int32)
    mx.eval(tok)
    prev = None
    for _ in range(tokens):
        tok = mx.argmax(model(tok, caches)[:, -1], axis=-1).astype(mx.int32).reshape(B, 1)
        mx.async_eval(tok)
        if read_each and prev is not None:
            np.array(prev)
        prev = tok
    mx.eval(tok)
    return tokens


def picks(model, caches, tokens, stacked):
    B = len(caches)
    samplers = [Sampler(SamplerSettings()) for _ in range(B)]
    logits = model(mx.zeros((B, 1), dtype=mx.int32), caches)
    nxt = [(samplers[b].token(logits[b, 0]), all_finite(logits[b, 0])) for b in range(B)]
    readback = mx.stack([mx.stack([t.astype(mx.int32), f.astype(mx.int32)]) for t, f in nxt]) if stacked else None
    mx.async_eval([x for p in nxt for x in p], *([readback] if stacked else []))
    for _ in range(tokens):
        fed = mx.concatenate([t.reshape(1, 1).astype(mx.int32) for t, _ in nxt])
        logits = model(fed, caches)
        following = [(samplers[b].token(logits[b, 0]), all_finite(logits[b, 0])) for b in range(B)]
        rb_next = mx.stack([mx.stack([t.astype(mx.int32), f.astype(mx.int32)]) for t, f in following]) \
            if stacked else None
        mx.async_eval([x for p in following for x in p], *([rb_next] if stacked else []))
        if stacked:
            values = np.array(readback)
            assert values.shape == (B, 2)
        else:
            for t, f in nxt:
                int(t.item())
                bool(f.item())
        nxt, readback = following, rb_next
    mx.eval([x for p in nxt for x in p])
    return tokens + 1   # the first logits' forward too


class _NoStops:
    """The tokenizer's stream decoder without stop ids: a random-weight model's greedy token may be
    one, and a slot that ended would leave the step."""

    def __init__(self, tokenizer):
        self.tokenizer, self.stop_ids = tokenizer, set()

    def streamer(self):
        return self.tokenizer.streamer()


class _Timed:
    """The model, with the moment each forward's graph is built recorded (`_decode` submits it
    right after, with the picks)."""

    def __init__(self, model):
        self.model, self.built = model, []

    def __call__(self, *args):
        out = self.model(*args)
        self.built.append(time.perf_counter())
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def engine_decode(model, caches, tokens, tokenizer, host: list):
    """Scheduler._decode over B slots built around `caches` (each slot as `_admit` and a finished
    prefill leave it: a sampler, a stream decoder, a stop matcher, its logits). Appends to `host`
    the run's host timeline: per `_decode` call k, the time from building step k to the first
    slot's emit (`wait`: the submission, then `.item()` blocking until step k - 1 is done) and from
    building step k to building step k + 1 (`period`), in ms. A wait near zero means the GPU
    was done before the host asked: the host, not the GPU, set that step."""
    timed = _Timed(model)
    sched = Scheduler(timed, _NoStops(tokenizer), 1, 8)
    sched.slots = [Slot(b, c) for b, c in enumerate(caches)]
    ready: list[float] = []
    logits = timed(mx.zeros((len(caches), 1), dtype=mx.int32), caches)
    for b, slot in enumerate(sched.slots):
        emit = (lambda e: ready.append(time.perf_counter()) if "token" in e else None) if b == 0 else (lambda e: None)
        slot.request = Request([], 1 << 30, SamplerSettings(), emit)
        slot.sampler, slot.streamer, slot.stop = Sampler(slot.request.sampling), sched.tokenizer.streamer(), StopMatcher([])
        slot.logits, slot.state = logits[b, 0], "decode"
    for _ in range(tokens):
        sched._decode(sched.slots)
    mx.eval([x for s in sched.slots for x in (s.next or ()) if x is not None])
    built = timed.built[1:]   # built[k]: step k's, in _decode call k
    host.append({"wait_ms": [1e3 * (r - b) for r, b in zip(ready, built)],
                 "period_ms": [1e3 * (b1 - b0) for b0, b1 in zip(built, built[1:])]})
    return tokens + 1


# One worker thread for every threaded variant, for the whole run: MLX keeps compiled functions
# (and CUDA graphs) per thread, so a fresh thread a run would trace the step again each time,
# which the server's one long-lived thread does once.
_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probe-worker")


def threaded(run):
    """`run` on the worker thread, waited for: its result, or its exception re-raised here."""
    def go(model, caches, tokens):
        def body():
            out = run(model, caches, tokens)
            settle(caches)   # the main thread cannot evaluate what the worker left lazy
            return out
        return _WORKER.submit(body).result()
    return go


class EngineRun:
    """The Scheduler as the server runs it: its own thread's loop (`run`: cancellations,
    admissions, prefills, then `_decode`) over B slots around `caches`, set up on that thread
    (`control`), each slot's request ending after `tokens` tokens. One Scheduler, and so one
    thread, per set of caches (a new one when B changes), for the reason above."""

    def __init__(self, tokenizer, host: list):
        self.tokenizer, self.sched, self.key, self.host = tokenizer, None, None, host

    def __call__(self, model, caches, tokens):
        if self.key != tuple(map(id, caches)):
            self.close()
            self.sched = Scheduler(model, _NoStops(self.tokenizer), 1, 8)
            self.sched.slots = [Slot(b, c) for b, c in enumerate(caches)]
            self.sched.thread.start()
            self.key = tuple(map(id, caches))
        sched, done = self.sched, [threading.Event() for _ in caches]
        timed = _Timed(model)

        def setup():
            sched.model = timed
            logits = timed(mx.zeros((len(caches), 1), dtype=mx.int32), caches)
            for b, slot in enumerate(sched.slots):
                ended = lambda e, d=done[b]: d.set() if "finish_reason" in e or "error" in e else None
                slot.request = Request([], tokens + 1, SamplerSettings(), ended)
                slot.sampler, slot.streamer = Sampler(slot.request.sampling), sched.tokenizer.streamer()
                slot.stop, slot.generated, slot.logits, slot.state = StopMatcher([]), 0, logits[b, 0], "decode"
        start = time.perf_counter()
        sched.control(setup)
        for d in done:
            d.wait()
        sched.control(lambda: settle(caches))
        end, built = time.perf_counter(), timed.built
        # the steps' own periods, and the run's time outside them: from the call to the first
        # build and from the last build to the return (set-up, the last step, the hand-offs)
        self.host.append({"period_ms": [1e3 * (b1 - b0) for b0, b1 in zip(built, built[1:])],
                          "outside_ms": 1e3 * ((built[0] - start) + (end - built[-1]))})
        return tokens + 1   # the first logits' forward and `tokens` steps

    def close(self):
        if self.sched is not None:
            self.sched.stop()
            self.sched.thread.join(60)
            self.sched = None


def settle(caches) -> None:
    mx.eval([x for c in caches for x in c.state()])


def variants(tokenizer, host: dict) -> dict:
    """The variants by name; `decode` and `decodeT` append their host timelines to host[name]."""
    decode = lambda name: lambda m, c, n: engine_decode(m, c, n, tokenizer, host.setdefault(name, []))
    pick = lambda m, c, n: picks(m, c, n, False)
    return {"packed": lambda m, c, n: packed(m, c, n, False), "read1": lambda m, c, n: packed(m, c, n, True),
            "picks": pick, "picks1": lambda m, c, n: picks(m, c, n, True), "picksT": threaded(pick),
            "decode": decode("decode"), "decodeT": threaded(decode("decodeT")),
            "sched": EngineRun(tokenizer, host.setdefault("sched", []))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--batch", default="1,2,4")
    p.add_argument("--depth", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default="", help="a comma-separated subset of the variants (default: all)")
    args = p.parse_args()
    model = Model(open_artifact(args.model))
    host: dict[str, list] = {}
    VARIANTS = variants(MuseTokenizer(model.artifact.vocabulary), host)
    if args.variants:
        VARIANTS = {k: v for k, v in VARIANTS.items() if k in args.variants.split(",")}
    cells = []
    for B in [int(b) for b in args.batch.split(",")]:
        caches = [model.make_cache(args.depth + args.tokens + 8) for _ in range(B)]
        for c in caches:
            c.fill_random(args.depth)
        samples = {v: [] for v in VARIANTS}
        for name, run in VARIANTS.items():   # warm-up: every trace and kernel of this B
            settle(caches)
            rewind(caches, args.depth)
            run(model, caches, 4)
        for runs in host.values():
            runs.clear()
        for _ in range(args.reps):
            for name, run in VARIANTS.items():
                settle(caches)   # a thread cannot evaluate what another left lazy
                rewind(caches, args.depth)   # every variant, every pass at the same depth
                t = time.perf_counter()
                forwards = run(model, caches, args.tokens)
                samples[name].append(B * forwards / (time.perf_counter() - t))
        for name, s in samples.items():
            line = f"B={B} {name:>7}: {np.mean(s):.1f} tok/s aggregate ({', '.join(f'{x:.1f}' for x in s)}); " \
                   f"depth {args.depth}..{args.depth + args.tokens + 1}"
            cell = {"batch": B, "variant": name, "tok_s": s, "depth_start": args.depth}
            if host.get(name):
                period = [p for run in host[name] for p in run["period_ms"]]
                cell["host"] = list(host[name])
                line += f"; host: step {np.median(period):.2f} ms median, {np.mean(period):.2f} mean"
                wait = [w for run in host[name] for w in run.get("wait_ms", [])]
                if wait:
                    line += f", wait {np.median(wait):.2f} ms median, {np.mean(np.array(wait) < 0.2):.0%} under 0.2 ms"
                outside = [run["outside_ms"] for run in host[name] if "outside_ms" in run]
                if outside:
                    line += f", outside the steps {np.median(outside):.1f} ms a run (median)"
            print(line, flush=True)
            cells.append(cell)
        for run in VARIANTS.values():
            if isinstance(run, EngineRun):
                run.close()
        del caches
    receipt = make_receipt("research/engine-gap", inputs={"model": args.model, "batch": args.batch,
                                                          "depth": args.depth, "tokens": args.tokens, "reps": args.reps},
                           metrics={"cells": cells}, synthetic=True,
                           notes=["K/V rows random (SlotCache.fill_random); every run from the same depth (rewound)"])
    Path(args.out).write_text(json.dumps(receipt, indent=1))
    return 0


def rewind(caches, depth: int) -> None:
    """Every layer of every cache back to `depth` positions held (the rows past it are never read),
    so that each variant runs over the same depth whatever ran before it."""
    for c in caches:
        for layer in c.layers:
            layer.offset = depth


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # past the receipt, no teardown: the worker's and the schedulers' threads hold MLX streams,
    # whose destruction at interpreter exit aborted the process (2026-12-04, e8f3920)
    os._exit(code)
