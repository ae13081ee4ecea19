"""Slots: up to N sequences decoded together by one forward (the server's engine side).

One thread owns the model and every MLX call (`Scheduler.run`). Each loop:

1. admits waiting requests into idle slots (a request's prompt restores the deepest prompt-cache
   checkpoint it shares, when a prompt cache is given);
2. feeds each prefilling slot one chunk (ending at a multiple of the prefill chunk), so the
   slots already decoding keep producing while a long prompt is read;
3. takes one decode step for every decoding slot at once: the next token of each from its
   logits (its own sampler, seed and stop state), fed back by one forward over the B tokens
   (Model.__call__ with B caches: each weight read once for all of them), built from the lazy
   tokens and submitted before they are read (pipelined, as the CLI's decode loop).

Requests hear back through `emit` (called from this thread; the HTTP side makes it thread-safe):
`{"prompt_logprobs": [(id, log-prob or None, [(id, log-prob), ...]), ...]}` per prefill chunk when the
request asks for them, then `{"text": delta, "token": id, "logprob": ..., "top_logprobs": [...]}` per token, then
`{"finish_reason": "stop" | "length", "stop_type": "eos" | "word" | "limit", "stopping_word": str,
"usage": {...}, "timings": {...}, "id_slot": n}`, or `{"error": message}` (with `"invalid": true` where the
request's own grammar ended it) (stop_type and stopping_word
are llama-server's: a stop token, a stop string (the one matched), a length limit).
A request cancelled by its client (`cancel()`) frees its slot at the next loop. `timings` are
llama-server's: the prompt tokens taken from the prompt cache (`cache_n`) and prefilled
(`prompt_n`) and the time from admission to the first token's logits (`prompt_ms`, with the
prompt cache's restore and stores in it, also apart: `prompt_cache_ms`), then the tokens generated
(`predicted_n`) and the time from those logits to the request's end (`predicted_ms`).
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from .errors import MuseError, NonFiniteError
from .geometry import PREFILL_CHUNK
from .grammar import GrammarError
from .kv import SlotCache
from .metrics import ServerMetrics
from .sampling import Sampler, SamplerSettings, all_finite


class QueueFull(MuseError):
    """More requests waiting than the queue holds."""


class StopMatcher:
    """Stop strings matched across token boundaries: text is released only up to where no stop
    string could still begin, and never past a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.word = ""   # the stop string found, once one is

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            at, self.word = min(hits, key=lambda h: h[0])   # the earliest; a tie, the first listed (llama-server)
            out, self.pending = self.pending[:at], ""
            return out, True
        hold = max((_overlap(self.pending, s) for s in self.stops), default=0)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` (shorter than `stop`): where a
    stop string could still begin. Each candidate start is an occurrence of stop's first character,
    tried longest first and compared once (memcmp), so a request's stop strings cost the engine
    thread about their length a token, not its square."""
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i != -1:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplerSettings
    emit: Callable[[dict], None]
    stop_strings: list[str] = field(default_factory=list)
    logprobs: int | None = None          # None: off; k >= 0: the chosen token's and the top k
    slot: int | None = None              # llama-server's id_slot: wait for this slot (None: any)
    ignore_eos: bool = False             # llama-server's: the stop tokens are sampled as any other
    prompt_logprobs: int | None = None   # None: off; k >= 0: each prompt token's log-prob and the top k
    constraint: object = None            # a grammar the output follows (grammar.Constraint), this request's own
    shown: frozenset = frozenset()       # control tokens whose text the output shows (a chat format's markup)
    dry_breakers: dict | None = None     # DRY's breakers as tokens (MuseTokenizer.dry_breakers; None: made here)
    post_sampling: bool = False          # log-probs of what the pick drew from, not of the model (llama-server's)
    # llama-server's t_max_predict_ms: past this many ms from the first token's logits, a token whose
    # text holds a newline ends the request (finish "length"); <= 0: no limit
    t_max_predict_ms: float = 0.0
    # Another request with the same prompt (a choice of one `n`): this one waits until the leader's
    # prompt is prefilled, then takes a copy of it when a slot is idle at that moment.
    leader: "Request | None" = None
    prompt_settled: bool = False         # as a leader: its prompt is prefilled, or never will be
    id: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class Slot:
    def __init__(self, index: int, cache: SlotCache):
        self.index, self.cache = index, cache
        self.request: Request | None = None
        self.state = "idle"
        self.pending: list[int] = []
        self.logits: mx.array | None = None   # the next token's, while decoding
        self.next: tuple | None = None        # that token, lazily (Scheduler._picks)
        self.fed = False                      # that token is already fed back by the step in flight
        self.following: tuple | None = None   # the token after it, from that step (lazy)
        self.generated = 0
        self.sampler: Sampler | None = None
        self.streamer = None
        self.stop: StopMatcher | None = None
        self.tokens: list[int] = []           # what the cache holds
        self.restored = False                 # holds a restored pack: a request extending its tokens reuses it
        self.cached = 0                       # the request's prompt tokens it did not prefill (usage's cached_tokens)
        self.admitted = self.prompt_done = 0.0   # perf_counter at admission and at the first token's logits
        self.cache_seconds = 0.0              # the prompt cache's restore and stores for this request

    def describe(self) -> dict:
        return {"id": self.index, "state": self.state, "n_ctx": self.cache.context, "n_past": self.cache.offset,
                "request": self.request.id if self.request else None, "generated": self.generated}


class Scheduler:
    def __init__(self, model, tokenizer, n_slots: int, context: int, queue_max: int = 16, prompt_cache=None,
                 chunk: int = PREFILL_CHUNK):
        self.model, self.tokenizer, self.context, self.chunk = model, tokenizer, context, chunk
        self.slots = [Slot(i, model.make_cache(context)) for i in range(n_slots)]
        mx.eval([s.cache.state() for s in self.slots])
        self.kv_bytes = sum(s.cache.nbytes for s in self.slots)
        self.queue_max, self.prompt_cache = queue_max, prompt_cache
        self.waiting: collections.deque[Request] = collections.deque()
        self.controls: collections.deque = collections.deque()
        self.wake = threading.Condition()
        self.running = True
        self.ids = itertools.count(1)
        self.metrics = ServerMetrics()
        self.thread = threading.Thread(target=self.run, name="muse-slots", daemon=True)

    # ---- the HTTP side's calls (any thread) ----

    def submit(self, request: Request) -> None:
        with self.wake:
            idle = sum(1 for s in self.slots if s.state == "idle")
            if len(self.waiting) >= self.queue_max + idle:
                raise QueueFull(f"{len(self.waiting)} requests are waiting for {len(self.slots)} busy slots")
            request.id = request.id or f"req-{next(self.ids)}"
            self.waiting.append(request)
            self.wake.notify()

    def control(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the scheduler's thread between steps; its result or exception is returned or raised."""
        done, box = threading.Event(), {}

        def call():
            try:
                box["value"] = fn()
            except BaseException as exc:   # handed to the caller's thread
                box["error"] = exc
            done.set()
        with self.wake:
            self.controls.append(call)
            self.wake.notify()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def describe(self) -> list[dict]:
        return [s.describe() for s in self.slots]

    # A prompt this long takes the prefill's own path (longer than the decode step's rows).
    WARM_UP_PROMPT = 8

    def warm_up(self) -> float:
        """Before serving (the thread started, no request yet): on the scheduler's own thread, one
        short prefill and one decode step over 1..N slots, so that the first requests do not pay
        for loading or compiling the kernels and tracing the compiled step (MLX keeps compiled
        functions per thread), as llama-server warms up unless --no-warmup. The slots are empty
        again after it; nothing reaches the prompt cache. -> seconds taken."""
        def run() -> float:
            t = time.perf_counter()
            n = min(self.WARM_UP_PROMPT, self.context - 1)   # and room for the decode step
            if n < 1:
                return 0.0
            caches = [slot.cache for slot in self.slots]
            logits = []
            for cache in caches:
                cache.reset()
                logits.append(self.model.prefill([0] * n, cache))
            mx.eval(logits)
            for b in range(1, len(caches) + 1):
                mx.eval(self.model(mx.zeros((b, 1), dtype=mx.int32), caches[:b]))
            for slot in self.slots:
                slot.cache.reset()
                slot.tokens = []
            return time.perf_counter() - t
        return self.control(run)

    def stop(self) -> None:
        with self.wake:
            self.running = False
            self.wake.notify()

    # ---- the scheduler's thread ----

    def run(self) -> None:
        while True:
            with self.wake:
                while self.running and not self.controls and not (self.waiting and self._idle()) and \
                        not any(s.state != "idle" for s in self.slots):
                    self.wake.wait(timeout=0.5)
                if not self.running:
                    return
                controls, self.controls = list(self.controls), collections.deque()
            for call in controls:
                call()
            try:
                self.step()
            except Exception as exc:   # an engine fault ends the requests it touched, never the loop
                for slot in self.slots:
                    if slot.request is not None:
                        self._finish(slot, error=f"engine error: {type(exc).__name__}: {exc}")

    def busy_slots(self) -> int:
        return sum(1 for s in self.slots if s.state != "idle")

    def _idle(self) -> Slot | None:
        return next((s for s in self.slots if s.state == "idle"), None)

    def _slot_for(self, request: Request) -> Slot | None:
        """The slot a request asked for, when idle; for any slot, an idle slot holding a restored
        pack whose tokens the prompt extends, else any idle slot that holds no restored pack, else
        any idle slot; None when there is none to take."""
        if request.leader is not None and not request.leader.prompt_settled:
            return None   # its prompt is on its way into the leader's slot
        if request.slot is not None:
            slot = self.slots[request.slot]
            return slot if slot.state == "idle" else None
        idle = [s for s in self.slots if s.state == "idle"]
        if not idle:
            return None
        n = len(request.prompt_ids)
        for slot in sorted(idle, key=lambda s: -len(s.tokens)):
            if slot.restored and len(slot.tokens) < n and request.prompt_ids[:len(slot.tokens)] == slot.tokens:
                return slot
        return next((s for s in idle if not s.restored), idle[0])

    def step(self) -> None:
        for slot in self.slots:   # a client that went away frees its slot
            if slot.request is not None and slot.request.cancelled.is_set():
                self._release(slot)
        while True:   # the first waiting request that has a slot (one asking for a busy slot waits)
            with self.wake:
                pick = next(((r, s) for r in self.waiting for s in [self._slot_for(r)] if s is not None), None)
                if pick is not None:
                    self.waiting.remove(pick[0])
            if pick is None:
                break
            if not pick[0].cancelled.is_set():
                self._admit(pick[1], pick[0])
            else:
                pick[0].prompt_settled = True   # a leader that never ran frees its followers
        for slot in [s for s in self.slots if s.state == "prefill"]:
            self._prefill_chunk(slot)
        decoding = [s for s in self.slots if s.state == "decode"]
        if decoding:
            self._decode(decoding)

    def _begin(self, slot: Slot, request: Request) -> None:
        """`request` takes `slot`: its own sampler (the penalties see the prompt), text streamer and stop state."""
        slot.request, slot.generated = request, 0
        slot.admitted, slot.cache_seconds = time.perf_counter(), 0.0
        slot.sampler = Sampler(request.sampling, request.prompt_ids, self.tokenizer.vocab.suppress_ids,
                               request.constraint, request.dry_breakers if request.dry_breakers is not None else
                               self.tokenizer.dry_breakers(request.sampling.dry_sequence_breakers)
                               if request.sampling.dry else None)
        slot.streamer = self.tokenizer.streamer(request.shown)
        slot.stop = StopMatcher(request.stop_strings)

    def _admit(self, slot: Slot, request: Request) -> None:
        self._begin(slot, request)
        start = 0
        n = len(request.prompt_ids)
        if request.prompt_logprobs is not None:
            pass   # every prompt position's logits are wanted: nothing restored, the whole prompt prefilled
        elif slot.restored and len(slot.tokens) < n and request.prompt_ids[:len(slot.tokens)] == slot.tokens:
            start = len(slot.tokens)   # the request extends the pack restored here (a handoff)
        elif self.prompt_cache is not None:
            t = time.perf_counter()
            hit = self.prompt_cache.lookup(request.prompt_ids, self.context)
            slot.cache_seconds += time.perf_counter() - t
            if hit.cache is not None:
                slot.cache, start = hit.cache, hit.reused
            if hit.logits is not None:   # the prompt's exact end: nothing to prefill
                slot.restored, slot.cached = False, n
                slot.tokens, slot.pending = list(request.prompt_ids), []
                slot.logits, slot.state = mx.array(hit.logits), "decode"
                self._prompt_ready(slot)
                return
        slot.restored, slot.cached = False, start
        if start == 0:
            slot.cache.reset()
        slot.tokens = list(request.prompt_ids[:start])
        slot.pending = list(request.prompt_ids[start:])
        slot.state = "prefill"

    def _prefill_chunk(self, slot: Slot) -> None:
        n = self.chunk - slot.cache.offset % self.chunk
        piece, slot.pending = slot.pending[:n], slot.pending[n:]
        self.metrics.on_call(self.busy_slots())
        k = slot.request.prompt_logprobs
        logits = self.model.prefill(piece, slot.cache, self.chunk, all_logits=k is not None)
        if k is not None:
            self._emit_prompt_logprobs(slot, len(slot.tokens), logits, k)
        slot.tokens += piece
        offset, n_prompt = slot.cache.offset, len(slot.request.prompt_ids)
        if self.prompt_cache is not None and slot.pending and offset in self.prompt_cache.checkpoints(offset - 1,
                                                                                                      n_prompt):
            t = time.perf_counter()
            self.prompt_cache.store(slot.cache, list(slot.tokens), {})
            slot.cache_seconds += time.perf_counter() - t
        if not slot.pending:
            slot.logits, slot.state = logits[-1], "decode"
            if self.prompt_cache is not None:
                t = time.perf_counter()
                self.prompt_cache.store_end(slot.cache, list(slot.tokens), slot.logits)
                slot.cache_seconds += time.perf_counter() - t
            self._prompt_ready(slot)

    def _emit_prompt_logprobs(self, slot: Slot, start: int, logits: mx.array, k: int) -> None:
        """The prompt tokens this chunk's logits predict, each with its log-prob and the top k (found
        on the device, sorted here by value then id): rows start.. of the prompt predict its tokens
        start + 1..; the prompt's first token, which nothing predicts, comes first with None."""
        prompt = slot.request.prompt_ids
        n = min(logits.shape[0], len(prompt) - start - 1)
        out = [(prompt[0], None, [])] if start == 0 else []
        if n > 0:
            lp = logits[:n].astype(mx.float32)
            lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
            nxt = mx.array(np.asarray(prompt[start + 1:start + 1 + n], dtype=np.int32))
            chosen = mx.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]
            k = min(k, lp.shape[-1])
            if k:
                top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
                values = mx.take_along_axis(lp, top, axis=-1)
                mx.eval(chosen, top, values)
                tops = [sorted(zip(i, v), key=lambda p: (-p[1], p[0]))
                        for i, v in zip(np.array(top).tolist(), np.array(values).tolist())]
            else:
                tops = [[] for _ in range(n)]
            out += [(prompt[start + 1 + j], c, tops[j]) for j, c in enumerate(np.array(chosen).tolist())]
        if out:
            slot.request.emit({"prompt_logprobs": out})

    def _prompt_ready(self, slot: Slot) -> None:
        """`slot` holds its request's whole prompt and the next token's logits: its decoding starts;
        the requests that follow it (the other choices of its `n`) waiting now take copies of the
        prompt into idle slots, and the rest are free to prefill it themselves."""
        slot.prompt_done = time.perf_counter()
        leader = slot.request
        leader.prompt_settled = True
        with self.wake:
            followers = [r for r in self.waiting if r.leader is leader and not r.cancelled.is_set()]
        for request in followers:
            target = self._slot_for(request)
            if target is None:
                continue
            with self.wake:
                self.waiting.remove(request)
            self._admit_copy(target, request, slot)
        if leader.max_tokens == 0:
            self._finish(slot, "length")

    def _admit_copy(self, slot: Slot, request: Request, source: Slot) -> None:
        """Admit `request` into `slot` with a copy of the prompt `source` has just prefilled."""
        self._begin(slot, request)
        slot.cache.copy_from(source.cache)
        slot.tokens, slot.pending = list(source.tokens), []
        slot.restored, slot.cached = False, len(request.prompt_ids)
        slot.logits, slot.state, slot.prompt_done = source.logits, "decode", time.perf_counter()
        request.prompt_settled = True
        if request.max_tokens == 0:
            self._finish(slot, "length")

    @staticmethod
    def _picks(slot: Slot) -> tuple:
        """The next token of `slot` from its logits, lazily: (token, all finite, and with logprobs
        asked for, the token's log-prob, then the top k's ids and log-probs in no order; the model's,
        or with `post_sampling` those of what the pick drew from). The top k
        are found on the device (argpartition), so the host reads k + 1 values a token, not the
        vocabulary's (sorting 202,048 log-probs on the host took ~14 ms a slot a token)."""
        token = slot.sampler.token(slot.logits)
        finite = all_finite(slot.logits)
        k = slot.request.logprobs
        if k is None:
            return token, finite
        if slot.request.post_sampling:   # what the pick drew from: after the chain (a greedy pick: itself alone)
            drawn = slot.sampler.drawn
            lp = (mx.where(mx.arange(slot.logits.size) == token, 0.0, -mx.inf) if drawn is None
                  else drawn - mx.logsumexp(drawn))
        else:
            lp = slot.logits.reshape(-1) - mx.logsumexp(slot.logits)
        k = min(k, lp.size)
        if not k:
            return token, finite, lp[token]
        top = mx.argpartition(-lp, k - 1)[:k]
        return token, finite, lp[token], top, lp[top]

    def _decode(self, slots: list[Slot]) -> None:
        """One decode step, pipelined as the CLI's (generate.decode_tokens): the forward that feeds
        each slot's next token back is built from that token's lazy value and submitted before any
        token is read, so the host's reading, detokenizing and emitting overlap the GPU's step. A
        slot that then stops (a stop token or string, a non-finite row) was fed its last token all
        the same: its cache, and `tokens` with it, holds that token. A slot with a grammar or DRY has its
        next pick built once its token is read (the mask and the penalty follow it), at the start of
        the next step, and submitted alone ahead of that step's forward; it ends where its grammar
        takes nothing more."""
        picked = []
        for slot in list(slots):
            if slot.next is None:   # its logits came from a prefill or a restore, or its pick is paced
                try:
                    slot.next = self._picks(slot)
                except GrammarError as exc:   # its grammar allows no token: that request ends, the others go on
                    self._finish(slot, error=str(exc), invalid=True)
                    slots.remove(slot)
                    continue
                picked += slot.next
        if picked:   # submitted alone, ahead of the step fed from them: reading them waits for them only
            mx.async_eval(picked)
        ahead = [s for s in slots if s.cache.room > 0 and s.generated + 1 < s.request.max_tokens]
        if ahead:
            tokens = mx.concatenate([s.next[0].reshape(1, 1).astype(mx.int32) for s in ahead])
            self.metrics.on_call(self.busy_slots())
            logits = self.model(tokens, [s.cache for s in ahead])
            for b, slot in enumerate(ahead):
                slot.fed, slot.logits = True, logits[b, 0]
                # a paced pick (a grammar, DRY) waits for this step's token to be read
                slot.following = None if slot.sampler.paced else self._picks(slot)
            mx.async_eval([logits] + [x for s in ahead if s.following is not None for x in s.following])
        for slot in slots:
            token, finite, *logprobs = slot.next
            fed, slot.fed = slot.fed, False
            slot.next, slot.following = slot.following, None
            t = int(token.item())
            if fed:
                slot.tokens.append(t)
            if not bool(finite.item()):
                self._finish(slot, error=str(NonFiniteError(slot.cache.offset - 1 - fed)))
                continue
            if t in self.tokenizer.stop_ids and not slot.request.ignore_eos:
                self._finish(slot, "stop")
                continue
            try:
                slot.sampler.read(t)
            except GrammarError as exc:
                self._finish(slot, error=str(exc), invalid=True)
                continue
            slot.generated += 1
            event = {"token": t}
            if logprobs:
                event["logprob"] = float(logprobs[0].item())
                if len(logprobs) > 1:   # the top k, most likely first (ties: the lower id)
                    ids, values = np.array(logprobs[1]).tolist(), np.array(logprobs[2]).tolist()
                    event["top_logprobs"] = sorted(zip(ids, values), key=lambda p: (-p[1], p[0]))
            piece = slot.streamer.push(t)
            text, stopped = slot.stop.push(piece)
            event["text"] = text
            slot.request.emit(event)
            if stopped:
                self._finish(slot, "stop", flush=False)
            elif slot.sampler.constraint is not None and slot.sampler.constraint.done:
                self._finish(slot, "stop")   # the grammar takes nothing more
            elif not fed:   # max_tokens reached, or the context full
                self._finish(slot, "length")
            elif "\n" in piece and 0 < slot.request.t_max_predict_ms < (time.perf_counter() - slot.prompt_done) * 1e3:
                self._finish(slot, "length")   # llama-server's time limit, checked at a newline

    def _finish(self, slot: Slot, reason: str | None = None, error: str | None = None, flush: bool = True,
                invalid: bool = False) -> None:
        """invalid: the error is the request's own (its grammar reached a dead end), not the engine's."""
        request = slot.request
        if error is not None:
            request.emit({"error": error, "invalid": True} if invalid else {"error": error})
        else:
            if flush:   # the streamer's partial character and the text held back for a stop string
                tail, stopped = slot.stop.push(slot.streamer.flush())
                tail += "" if stopped else slot.stop.flush()
                if tail:
                    request.emit({"text": tail})
                if stopped:   # the tail ended on a stop string: that is why the request ends
                    reason = "stop"
            kind = "limit" if reason == "length" else "word" if slot.stop.word else "eos"
            timings = self._timings(slot)
            self.metrics.on_finish(timings["prompt_n"], slot.cached, timings["prompt_ms"] / 1e3, slot.generated,
                                   timings["predicted_ms"] / 1e3, len(request.prompt_ids) + slot.generated)
            request.emit({"finish_reason": reason, "stop_type": kind, "stopping_word": slot.stop.word, "usage": {
                "prompt_tokens": len(request.prompt_ids), "completion_tokens": slot.generated,
                "total_tokens": len(request.prompt_ids) + slot.generated,
                "prompt_tokens_details": {"cached_tokens": slot.cached}}, "timings": timings,
                "id_slot": slot.index})
        self._release(slot)

    @staticmethod
    def _timings(slot: Slot) -> dict:
        """llama-server's `timings` of the slot's request (the module's docstring says what each holds)."""
        prompt_n, predicted_n = len(slot.request.prompt_ids) - slot.cached, slot.generated
        prompt_ms = (slot.prompt_done - slot.admitted) * 1e3
        predicted_ms = (time.perf_counter() - slot.prompt_done) * 1e3

        def per(n: int, ms: float) -> dict:
            return {"per_token_ms": ms / n if n else None, "per_second": n / ms * 1e3 if n and ms > 0 else None}
        p, g = per(prompt_n, prompt_ms), per(predicted_n, predicted_ms)
        return {"cache_n": slot.cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": p["per_token_ms"], "prompt_per_second": p["per_second"],
                "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": g["per_token_ms"], "predicted_per_second": g["per_second"],
                "prompt_cache_ms": slot.cache_seconds * 1e3}

    def _release(self, slot: Slot) -> None:
        if slot.request is not None:
            slot.request.prompt_settled = True   # its followers, if any, wait no longer
        slot.request, slot.state, slot.pending, slot.logits = None, "idle", [], None
        slot.next, slot.fed, slot.following = None, False, None
        slot.sampler = slot.streamer = slot.stop = None

    # ---- slot save / restore (llama-server's /slots/{id}?action=...) ----

    def save_slot(self, index: int, path, model_id: dict) -> dict:
        from . import kvpack

        def save():
            slot = self.slots[index]
            if slot.state != "idle":
                raise MuseError(f"slot {index} is busy")
            t = time.perf_counter()
            fresh = not os.path.exists(path)
            try:
                kvpack.save(slot.cache, slot.tokens, model_id, path)
            except OSError:   # the disk refused it (full, read-only): nothing half-written is left
                if fresh:
                    shutil.rmtree(path, ignore_errors=True)
                raise
            return {"id_slot": index, "n_saved": len(slot.tokens), "ms": (time.perf_counter() - t) * 1e3}
        return self.control(save)

    def erase_slot(self, index: int) -> dict:
        """llama-server's erase: an idle slot forgets what it holds (its positions and tokens; a
        restored pack no longer offered to a prompt that extends it). The storage's rows are not
        zeroed: they are past the offset, where nothing reads."""
        def erase():
            slot = self.slots[index]
            if slot.state != "idle":
                raise MuseError(f"slot {index} is busy")
            n = len(slot.tokens)
            slot.cache.reset()
            slot.tokens, slot.restored = [], False
            return {"id_slot": index, "n_erased": n}
        return self.control(erase)

    def restore_slot(self, index: int, path, model_id: dict) -> dict:
        from . import kvpack

        def restore():
            slot = self.slots[index]
            if slot.state != "idle":
                raise MuseError(f"slot {index} is busy")
            t = time.perf_counter()
            cache, tokens = kvpack.restore(path, self.model.geometry, model_id["fingerprint"], self.context,
                                           upload=self.model.ops.upload)
            slot.cache, slot.tokens, slot.restored = cache, tokens, True
            return {"id_slot": index, "n_restored": len(tokens), "ms": (time.perf_counter() - t) * 1e3}
        return self.control(restore)
