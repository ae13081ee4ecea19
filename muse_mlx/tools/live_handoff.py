"""`python -m muse_mlx.tools.live_handoff --model X.gguf`: a KV handoff between two live servers, end to end.

Issue 16 item 6 (seed 000 §22.7, the disaggregated cell), over HTTP rather than by packs in one
process (`tools/handoff.py`). Two servers on one model, one slot each, each with its own
`--slot-save-path`: A (with a prompt cache, so that it can go on from its own prefill) and B
(with an API key). With `--held H` B first takes A's pack of the first H tokens. Then A prefills
all but the last of `--depth` tokens (`max_tokens: 0`) and hands its slot to B
(`POST /slots/0?action=handoff`: only the blobs B lacks, then the manifest); B decodes `--tokens`
greedy tokens from the whole prompt, and so does A from its own state. Recorded: both texts (B's
must be A's), A's prefill as the client saw it and as A's `timings` say (with the time its prompt
cache's checkpoints took apart), the payload bytes A sent against the full pack and, with nothing held, against the
formula from the file's geometry (the NoPE layers' rows of every position A held, the sliding
layers' rows of the last `sliding_window`: at the pinned geometry and 130,815 tokens
1,823,184,896 B), the bytes on the wire, and the times. The prompt is random token ids.
"""

from __future__ import annotations

import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import cli
from ..cli import Parser
from ..errors import MuseError
from ..geometry import Geometry
from .live_server import Server, add_flags


def formula_bytes(g: Geometry, positions: int) -> int:
    """A pack's K/V payload for `positions` held: every NoPE layer's rows, each ring's last window."""
    return g.n_full * positions * g.kv_row_bytes + g.n_swa * min(positions, g.sliding_window) * g.kv_row_bytes


def _post(url: str, path: str, body: dict, key: str | None = None, timeout: float = 3600) -> tuple[dict, float]:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t = time.perf_counter()
    r = httpx.post(url + path, json=body, headers=headers, timeout=timeout)
    seconds = time.perf_counter() - t
    if r.status_code != 200:
        raise MuseError(f"POST {path} answered {r.status_code}: {r.text[:1000]}")
    return r.json(), seconds


def run_cell(model: str, depth: int, held: int, tokens: int, ctx: int, work: Path, server_args: list[str],
             start_timeout: float, seed: int = 5) -> dict:
    from ..artifact import open_artifact

    g = open_artifact(model).geometry
    ids = [int(t) for t in np.random.default_rng(seed).integers(0, g.n_vocab, depth)]
    key = secrets.token_hex(8)
    for d in ("a", "b", "a-prompts"):
        (work / d).mkdir(parents=True, exist_ok=True)
    ctx_args = ["--ctx-size", str(ctx)] if ctx else []
    a = Server(model, [*ctx_args, "--slot-save-path", str(work / "a"), "--prompt-cache", str(work / "a-prompts"),
                       *server_args], work / "a.log", start_timeout)
    try:
        b = Server(model, [*ctx_args, "--slot-save-path", str(work / "b"), "--api-key", key, *server_args],
                   work / "b.log", start_timeout)
        try:
            cell: dict = {"depth": depth, "held": held, "tokens": tokens}
            if held:
                _post(a.url, "/v1/completions", {"prompt": ids[:held], "max_tokens": 0})
                first, _ = _post(a.url, "/slots/0?action=handoff", {"filename": "held", "to": b.url, "api_key": key})
                cell["held_handoff"] = first
            prefilled, cell["a_prefill_s"] = _post(a.url, "/v1/completions", {"prompt": ids[:-1], "max_tokens": 0})
            cell["a_prefill_timings"] = prefilled.get("timings")   # the server's own: its prompt cache's stores apart
            sent, cell["handoff_s"] = _post(a.url, "/slots/0?action=handoff",
                                            {"filename": "cell", "to": b.url, "api_key": key})
            cell["handoff"] = sent
            ask = {"prompt": ids, "max_tokens": tokens, "temperature": 0}
            on_b, cell["b_decode_s"] = _post(b.url, "/v1/completions", ask, key)
            on_a, cell["a_decode_s"] = _post(a.url, "/v1/completions", ask)
        finally:
            b.stop()
    finally:
        a.stop()
    positions = depth - 1
    cell.update(b_text=on_b["choices"][0]["text"], a_text=on_a["choices"][0]["text"],
                b_usage=on_b["usage"], a_usage=on_a["usage"], positions_sent=positions,
                payload_bytes_sent=sent["payload_bytes_sent"], payload_bytes_full=sent["payload_bytes_full"],
                wire_bytes=sent["bytes_sent"], formula_bytes=formula_bytes(g, positions),
                share=sent["payload_bytes_sent"] / sent["payload_bytes_full"])
    cell["b_equals_a"] = cell["b_text"] == cell["a_text"]
    cell["full_equals_formula"] = sent["payload_bytes_full"] == cell["formula_bytes"]
    return cell


def _cache_s(cell: dict) -> float:
    return ((cell.get("a_prefill_timings") or {}).get("prompt_cache_ms") or 0.0) / 1e3


def _command(argv=None) -> int:
    p = Parser(prog="python -m muse_mlx.tools.live_handoff", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the GGUF both servers load")
    p.add_argument("--depth", type=int, default=130_815, help="the prompt's tokens (A sends all but the last)")
    p.add_argument("--held", type=int, default=0, help="tokens whose pack B takes first (the delta cell)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens B and A decode after it")
    p.add_argument("--ctx-size", type=int, default=0, help="the servers' --ctx-size (default: theirs)")
    add_flags(p, "both servers", "the servers' slot folders and logs")
    args = p.parse_args(argv)
    from .receipts import check_output, make_receipt, write_receipt

    if args.receipt:
        check_output(args.receipt, "--receipt", suffix=".json")
    if args.depth < 2 or not 0 <= args.held < args.depth - 1 or args.tokens < 1:
        raise MuseError(f"need --depth >= 2, 0 <= --held < depth - 1 and --tokens >= 1 "
                        f"(got {args.depth}, {args.held}, {args.tokens})")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="muse-live-handoff-"))
    try:
        cell = run_cell(args.model, args.depth, args.held, args.tokens, args.ctx_size, work, args.server_arg,
                        args.start_timeout)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"handoff of {cell['positions_sent']:,} positions, {args.held:,} held by the receiver: payload sent "
          f"{cell['payload_bytes_sent']:,} of {cell['payload_bytes_full']:,} B ({cell['share']:.4%}), formula for the "
          f"full pack {cell['formula_bytes']:,} B; {cell['wire_bytes']:,} B on the wire; A's prefill "
          f"{cell['a_prefill_s']:.2f} s (its prompt cache's checkpoints {_cache_s(cell):.2f} s of it), the handoff "
          f"{cell['handoff_s']:.2f} s; B's {args.tokens} tokens equal A's: "
          f"{cell['b_equals_a']}{' (synthetic weights)' if args.synthetic else ''}", flush=True)
    agrees = cell["b_equals_a"] and cell["full_equals_formula"] and (
        args.held or cell["payload_bytes_sent"] == cell["formula_bytes"])
    if args.receipt:
        r = make_receipt("research/live-handoff", inputs={"model": args.model, "depth": args.depth, "held": args.held,
                                                          "tokens": args.tokens, "ctx_size": args.ctx_size,
                                                          "server_args": args.server_arg},
                         metrics={"cell": cell}, verdict="agrees" if agrees else "disagrees",
                         synthetic=args.synthetic or None)
        print(f"receipt: {write_receipt(args.receipt, r)}")
    return 0 if agrees else 1


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    sys.exit(main())
