"""`python -m muse_mlx.tools.load_test [--model X.gguf]`: a live server under load, every answer checked.

Issue 16 item 4. One server (`python -m muse_mlx.server`, `--parallel` slots, an API key) on the
model (default: the embedded one). `--requests` requests of random token ids with mixed prompt
lengths (`--prompt-len LO:HI`) and output lengths (`--max-tokens LO:HI`): every third sampled
(temperature 0.8, top-k 40, top-p 0.95, a seed of its own), the rest greedy; every other one
streamed (with `stream_options.include_usage`); every fifth with stop strings ("er", a blank line); every
seventh with penalties and a logit bias (frequency 0.5, presence 0.25, repeat 1.1 over the last 32
tokens, +2 on one token); sent with the official `openai` client. First each
request alone, one after another: its solo run. Then all of them, `--rounds` times over,
`--concurrency` at a time (more than the slots: the rest wait in the server's queue, which is made
at least that deep). Recorded for every request of every round: its error, if any; its text, finish
reason and completion tokens against its solo run's; its latency and, streamed, its time to the
first token. The server's resident memory is sampled through the rounds and read at each round's
end.

Verdict "passes" when no request failed, every text, finish reason and token count equals its solo
run's, and the resident memory after the last round is within `--rss-slack` MiB of after the first
(the first round is the warm-up; with one round memory is recorded, not judged). Exit 0 when it
passes, 1 when not, 2 for a bad flag. The receipt holds every request's record and the memory
samples. On the GPU's tensor-core products a concurrent step's sums are not a solo step's (docs/
server.md, Exactness): there greedy equality rests on the margin between the top two tokens, and a
flip is reported, not hidden; with `--server-arg=--batch-invariant` the sums are the same.

    python -m muse_mlx.tools.load_test [--model X.gguf] [--parallel 4] [--requests 200] [--concurrency 8]
        [--rounds 2] [--prompt-len 3:120] [--max-tokens 0:40] [--ctx-size C] [--server-arg=--reference]
        [--synthetic] [--receipt OUT.json]
"""

from __future__ import annotations

import secrets
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from .. import cli
from ..cli import Parser
from ..errors import MuseError
from ..sampling import SamplerSettings
from .live_server import Server, add_flags

SAMPLED = {"temperature": 0.8, "top_p": 0.95}
SAMPLED_EXTRA = {"top_k": 40}   # not an OpenAI field: sent in the body as llama-server takes it
STOPS = ["er", "\n\n"]           # every fifth request's stop strings
PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.25}   # every seventh request's, with
PENALTIES_EXTRA = {"repeat_penalty": 1.1, "repeat_last_n": 32}     # llama-server's fields, and a bias


@dataclass(frozen=True)
class Job:
    index: int
    prompt: list[int]
    max_tokens: int
    sampled: bool
    stream: bool
    seed: int
    stops: bool = False
    penalized: bool = False

    @property
    def bias(self) -> dict:
        """A penalized job's logit bias: +2 on one token below 256 (every vocabulary has its bytes)."""
        return {str(self.index * 37 % 256): 2.0} if self.penalized else {}

    def settings(self) -> SamplerSettings:
        """The sampler settings the server is asked for (a solo run in process takes the same)."""
        s = SamplerSettings(temp=SAMPLED["temperature"], top_p=SAMPLED["top_p"], top_k=SAMPLED_EXTRA["top_k"],
                            seed=self.seed) if self.sampled else SamplerSettings()
        if not self.penalized:
            return s
        return replace(s, **PENALTIES, **PENALTIES_EXTRA,
                       logit_bias=tuple((int(t), b) for t, b in self.bias.items()))


@dataclass
class Outcome:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    latency_s: float = 0.0
    first_token_s: float | None = None   # streamed requests: the first chunk with text


def span(text: str, flag: str, lowest: int) -> tuple[int, int]:
    """'LO:HI' (or one number) as an inclusive range with lowest <= LO <= HI."""
    try:
        parts = [int(v) for v in text.split(":")]
    except ValueError:
        raise MuseError(f"{flag}: expected LO:HI (integers), got {text!r}") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not lowest <= parts[0] <= parts[1]:
        raise MuseError(f"{flag}: expected LO:HI with {lowest} <= LO <= HI, got {text!r}")
    return parts[0], parts[1]


def make_jobs(n: int, n_vocab: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int], seed: int) -> list[Job]:
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        length = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        jobs.append(Job(i, [int(t) for t in rng.integers(0, n_vocab, length)],
                        int(rng.integers(max_tokens[0], max_tokens[1] + 1)), i % 3 == 0, i % 2 == 0,
                        int(rng.integers(0, 2**31)), i % 5 == 4, i % 7 == 5))
    return jobs


def send(client, job: Job) -> Outcome:
    """One request through the openai client; any failure is the outcome's error, never raised."""
    kw = dict(model="m", prompt=job.prompt, max_tokens=job.max_tokens, seed=job.seed)
    if job.stops:
        kw["stop"] = STOPS
    extra = {}
    if job.sampled:
        kw.update(SAMPLED)
        extra.update(SAMPLED_EXTRA)
    else:
        kw.update(temperature=0)
    if job.penalized:
        kw.update(PENALTIES, logit_bias=job.bias)
        extra.update(PENALTIES_EXTRA)
    if extra:
        kw["extra_body"] = extra
    out = Outcome()
    t = time.perf_counter()
    try:
        if job.stream:
            parts = []
            for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                if chunk.usage is not None:
                    out.completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.text and out.first_token_s is None:
                        out.first_token_s = time.perf_counter() - t
                    parts.append(choice.text or "")
                    out.finish_reason = choice.finish_reason or out.finish_reason
            out.text = "".join(parts)
        else:
            r = client.completions.create(**kw)
            out.text, out.finish_reason = r.choices[0].text, r.choices[0].finish_reason
            out.completion_tokens = r.usage.completion_tokens
    except Exception as exc:   # an error is what the load test counts; it must not end the run
        out.error = f"{type(exc).__name__}: {exc}"[:500]
    out.latency_s = time.perf_counter() - t
    return out


def differences(solo: list[Outcome], got: list[Outcome]) -> list[dict]:
    """Where a loaded request's answer is not its solo run's: errors, texts, finish reasons, counts."""
    out = []
    for i, (s, g) in enumerate(zip(solo, got, strict=True)):
        if g.error is not None or s.error is not None:
            out.append({"job": i, "what": "error", "solo": s.error, "loaded": g.error})
            continue
        for field in ("text", "finish_reason", "completion_tokens"):
            a, b = getattr(s, field), getattr(g, field)
            if a != b:
                d = {"job": i, "what": field, "solo": a, "loaded": b}
                if field == "text":
                    d["first_difference_at"] = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y),
                                                    min(len(a), len(b)))
                out.append(d)
    return out


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    v = np.asarray(values, dtype=np.float64)
    return {"n": len(values), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99)), "max": float(v.max())}


class MemorySampler:
    """The server's resident memory every `period` seconds on a thread: [(seconds, bytes)]."""

    def __init__(self, server: Server, period: float = 0.5):
        self.server, self.period, self.samples = server, period, []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.read()

    def read(self) -> int | None:
        rss = self.server.rss_bytes()
        if rss is not None:
            self.samples.append((round(time.perf_counter() - self._t0, 3), rss))
        return rss

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(model: str, jobs: list[Job], parallel: int, concurrency: int, rounds: int, server_args: list[str],
        work: Path, start_timeout: float, request_timeout: float, report=lambda phase, outcomes, seconds: None) -> dict:
    """The solo runs, then the rounds; `report` hears each phase as it ends ("solo" or the round's
    number, its outcomes, its seconds)."""
    import openai

    key = secrets.token_hex(8)
    queue = ["--queue", str(max(16, concurrency))]
    server = Server(model, [*queue, "--api-key", key, *server_args], work / "server.log", start_timeout, parallel)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=request_timeout)
        memory = MemorySampler(server)
        try:
            t = time.perf_counter()
            solo = [send(client, job) for job in jobs]
            solo_s = time.perf_counter() - t
            report("solo", solo, solo_s)
            loaded, walls, rss_end = [], [], []
            for _ in range(rounds):
                t = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    loaded.append(list(pool.map(lambda j: send(client, j), jobs)))
                walls.append(time.perf_counter() - t)
                rss_end.append(memory.read())
                report(len(walls), loaded[-1], walls[-1])
        finally:
            memory.stop()
        alive = server.proc.poll() is None
    finally:
        server.stop()
    return {"solo": solo, "solo_s": solo_s, "loaded": loaded, "walls": walls, "rss_end": rss_end,
            "rss_samples": memory.samples, "server_alive_after": alive}


def summarize(jobs: list[Job], result: dict, rss_slack: float) -> tuple[dict, bool]:
    rounds = []
    for got, wall in zip(result["loaded"], result["walls"]):
        diffs = differences(result["solo"], got)
        tokens = sum(o.completion_tokens or 0 for o in got)
        rounds.append({"wall_s": wall, "errors": sum(o.error is not None for o in got),
                       "differences": diffs, "completion_tokens": tokens, "tok_s": tokens / wall,
                       "latency_s": percentiles([o.latency_s for o in got if o.error is None]),
                       "first_token_s": percentiles([o.first_token_s for o in got if o.first_token_s is not None])})
    rss = result["rss_end"]
    growth = rss[-1] - rss[0] if len(rss) > 1 and None not in rss else None
    solo_errors = sum(o.error is not None for o in result["solo"])
    metrics = {"solo_errors": solo_errors, "solo_s": result["solo_s"], "rounds": rounds,
               "solo_first_token_s": percentiles([o.first_token_s for o in result["solo"]
                                                  if o.first_token_s is not None]),
               "rss_end_bytes": rss, "rss_growth_after_warm_up_bytes": growth,
               "server_alive_after": result["server_alive_after"],
               "greedy": sum(not j.sampled for j in jobs), "streamed": sum(j.stream for j in jobs),
               "with_stops": sum(j.stops for j in jobs)}
    passes = (solo_errors == 0 and result["server_alive_after"]
              and all(r["errors"] == 0 and not r["differences"] for r in rounds)
              and (growth is None or growth <= rss_slack * 2**20))
    return metrics, passes


def _command(argv=None) -> int:
    p = Parser(prog="python -m muse_mlx.tools.load_test", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a muse-glimmer GGUF (default: the embedded model)")
    p.add_argument("--parallel", type=int, default=4, help="the server's slots, 1..4 (default 4)")
    p.add_argument("--requests", type=int, default=200, help="requests a round (default 200)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--rounds", type=int, default=2, help="rounds under load after the solo runs (default 2)")
    p.add_argument("--prompt-len", default="3:120", help="prompt tokens, LO:HI (default 3:120)")
    p.add_argument("--max-tokens", default="0:40", help="max_tokens, LO:HI (default 0:40)")
    p.add_argument("--ctx-size", type=int, help="the server's --ctx-size (default: the model's)")
    p.add_argument("--seed", type=int, default=42, help="the jobs' random seed (default 42)")
    p.add_argument("--rss-slack", type=float, default=64.0, help="MiB the memory may grow after round 1 (default 64)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    add_flags(p, "the server", "the server's log")
    args = p.parse_args(argv)
    from ..artifact import open_artifact
    from ..default_model import default_model_path
    from .receipts import check_output, make_receipt, write_receipt

    if args.receipt:
        check_output(args.receipt, "--receipt", suffix=".json")
    for flag, value, lo in (("--parallel", args.parallel, 1), ("--requests", args.requests, 1),
                            ("--concurrency", args.concurrency, 1), ("--rounds", args.rounds, 1)):
        if value < lo:
            raise MuseError(f"{flag} must be >= {lo}, got {value}")
    if args.parallel > 4:
        raise MuseError(f"--parallel must be 1..4, got {args.parallel}")
    if not args.rss_slack >= 0:
        raise MuseError(f"--rss-slack must be >= 0 MiB, got {args.rss_slack}")
    prompt_len, max_tokens = span(args.prompt_len, "--prompt-len", 1), span(args.max_tokens, "--max-tokens", 0)
    try:
        import openai  # noqa: F401
    except ImportError:
        raise MuseError("the load test sends its requests with the official openai client: "
                        "pip install 'openai>=1.30' (or the test extra)") from None
    model = str(args.model if args.model is not None else default_model_path())
    g = open_artifact(model).geometry
    context = min(args.ctx_size or g.context_length, g.context_length)
    if prompt_len[1] >= context:
        raise MuseError(f"--prompt-len up to {prompt_len[1]} tokens does not fit a slot of {context} positions")
    jobs = make_jobs(args.requests, g.n_vocab, prompt_len, max_tokens, args.seed)
    server_args = (["--ctx-size", str(args.ctx_size)] if args.ctx_size else []) + args.server_arg
    label = " (synthetic weights)" if args.synthetic else ""
    solo = []

    def report(phase, outcomes, seconds):
        failed = sum(o.error is not None for o in outcomes)
        firsts = [o.first_token_s for o in outcomes if o.first_token_s is not None]
        first = f", first token median {np.median(firsts):.2f} s (streamed)" if firsts else ""
        if phase == "solo":
            solo[:] = outcomes
            print(f"{args.requests} requests alone in {seconds:.1f} s, {failed} failed{first}", flush=True)
            return
        tokens = sum(o.completion_tokens or 0 for o in outcomes)
        latency = np.median([o.latency_s for o in outcomes])
        print(f"round {phase}: {args.requests} requests, {args.concurrency} at a time on {args.parallel} slot(s), "
              f"{seconds:.1f} s, {failed} failed, {len(differences(solo, outcomes))} unlike their solo runs, "
              f"{tokens / seconds:.1f} tok/s aggregate, latency median {latency:.2f} s{first}{label}", flush=True)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="muse-load-test-"))
    try:
        result = run(model, jobs, args.parallel, args.concurrency, args.rounds, server_args, work,
                     args.start_timeout, args.request_timeout, report)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    metrics, passes = summarize(jobs, result, args.rss_slack)
    growth = metrics["rss_growth_after_warm_up_bytes"]
    if growth is not None:
        print(f"server memory after the warm-up round {metrics['rss_end_bytes'][0] / 2**20:,.0f} MiB, "
              f"after the last {metrics['rss_end_bytes'][-1] / 2**20:,.0f} MiB ({growth / 2**20:+,.1f})", flush=True)
    else:
        print("server memory not judged: " + ("one round only" if args.rounds == 1
                                             else "its resident memory could not be read (no /proc)"), flush=True)
    print("passes" if passes else "fails", flush=True)
    if args.receipt:
        samples = {"solo": [asdict(o) for o in result["solo"]],
                   "rounds": [[asdict(o) for o in got] for got in result["loaded"]],
                   "rss": result["rss_samples"]}
        inputs = {"model": model, "parallel": args.parallel, "requests": args.requests, "concurrency":
                  args.concurrency, "rounds": args.rounds, "prompt_len": prompt_len, "max_tokens": max_tokens,
                  "ctx_size": args.ctx_size, "seed": args.seed, "rss_slack_mib": args.rss_slack,
                  "server_args": args.server_arg, "sampled": {**SAMPLED, **SAMPLED_EXTRA},
                  "jobs": [{"prompt_tokens": len(j.prompt), "max_tokens": j.max_tokens, "sampled": j.sampled,
                            "stream": j.stream, "seed": j.seed, "stops": STOPS if j.stops else None} for j in jobs]}
        r = make_receipt("research/load-test", inputs=inputs, metrics=metrics, samples=samples,
                         verdict="passes" if passes else "fails", synthetic=args.synthetic or None)
        print(f"receipt: {write_receipt(args.receipt, r)}")
    return 0 if passes else 1


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    cli.exit_now(main())
