"""Train the tiny Muse Glimmer (docs/tiny-model.md) with MLX: on the H200 through MLX's CUDA
backend, or a few steps on any CPU (the tests).

`TinyMuse` is the architecture of model.py written for training -- dense float32 weights named
as the GGUF names them, the whole sequence at once, no cache -- with every feature on: the 3:1
sliding / full pattern with a window shorter than the training context, GQA, QK-norm, the
sigmoid output gate, sandwich norms, NoPE on the full layers, the logit scale and the softcap.
Its logits agree with the engine's on the exported GGUF (tests/test_tiny_model.py), which is
what makes the engine's numbers about this model mean anything.

    python -m muse_mlx.tools.tiny_train DATA_DIR OUTDIR [--steps N] [--max-seconds S]
      DATA_DIR: train.npy, heldout.npy (tools/tiny_data.py)
      OUTDIR:   weights-*.safetensors (float16 matrices, float32 vectors, the geometry in the
                metadata), train-receipt.json (command, revision, device, versions, the loss
                curves, held-out perplexity, wall time)
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from functools import partial
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from .. import cli
from ..cli import Parser
from ..errors import MuseError
from ..geometry import POST_NORM_EPS, Geometry
from .receipts import make_receipt, write_receipt

# n_embd, n_ff and n_head * head_dim are multiples of 256 so that llama.cpp's K-quants take
# every matrix (a row of 384 would fall back to Q5_0, a type the engine does not read).
TINY_GEOMETRY = Geometry(
    n_layer=8, n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_ff=768, n_vocab=4096,
    sliding_window=128, context_length=512, rms_eps=1e-6, rope_base=1_000_000.0, rope_base_swa=10_000.0,
    logit_scale=0.5, final_logit_softcap=30.0,
)


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 512
    batch: int = 32
    steps: int = 1500
    warmup: int = 100
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 0
    grad_clip: float = 1.0


class Layer(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        D, qd, kvd = g.n_embd, g.n_head * g.head_dim, g.n_head_kv * g.head_dim
        self.attn_norm, self.ffn_norm = mx.ones((D,)), mx.ones((D,))
        self.post_attention_norm, self.post_ffw_norm = mx.ones((D,)), mx.ones((D,))
        self.attn_q_norm, self.attn_k_norm = mx.ones((g.head_dim,)), mx.ones((g.head_dim,))
        self.attn_q, self.attn_gate = nn.Linear(D, qd, bias=False), nn.Linear(D, qd, bias=False)
        self.attn_k, self.attn_v = nn.Linear(D, kvd, bias=False), nn.Linear(D, kvd, bias=False)
        self.attn_output = nn.Linear(qd, D, bias=False)
        self.ffn_gate, self.ffn_up = nn.Linear(D, g.n_ff, bias=False), nn.Linear(D, g.n_ff, bias=False)
        self.ffn_down = nn.Linear(g.n_ff, D, bias=False)


def causal_mask(T: int, window: int | None) -> mx.array:
    """Additive mask (T, T): key j visible to query i iff j <= i and (window: i - j < window)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    return mx.array(np.where(visible, 0.0, -np.inf).astype(np.float32))


class TinyMuse(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.g = g
        self.token_embd = mx.random.normal((g.n_vocab, g.n_embd))
        self.blk = [Layer(g) for _ in range(g.n_layer)]
        self.output_norm = mx.ones((g.n_embd,))
        self.output = nn.Linear(g.n_embd, g.n_vocab, bias=False)

    def attention(self, i: int, lay: Layer, h: mx.array, masks: dict) -> mx.array:
        g = self.g
        B, T, _ = h.shape
        q = mx.fast.rms_norm(lay.attn_q(h).reshape(B, T, g.n_head, g.head_dim), lay.attn_q_norm, g.rms_eps)
        k = mx.fast.rms_norm(lay.attn_k(h).reshape(B, T, g.n_head_kv, g.head_dim), lay.attn_k_norm, g.rms_eps)
        v = lay.attn_v(h).reshape(B, T, g.n_head_kv, g.head_dim)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))          # (B, heads, T, hd)
        if g.is_swa(i):   # ggml's NORM mode rotates adjacent pairs: MLX's "traditional" RoPE
            q = mx.fast.rope(q, g.rope_dim, traditional=True, base=g.rope_base_swa, scale=1.0, offset=0)
            k = mx.fast.rope(k, g.rope_dim, traditional=True, base=g.rope_base_swa, scale=1.0, offset=0)
        group = g.n_head // g.n_head_kv
        qg = q.reshape(B, g.n_head_kv, group, T, g.head_dim)
        scores = (qg @ k[:, :, None].swapaxes(-1, -2)) * (1.0 / math.sqrt(g.head_dim))
        probs = mx.softmax(scores + masks[g.is_swa(i)], axis=-1, precise=True)
        a = (probs @ v[:, :, None]).reshape(B, g.n_head, T, g.head_dim).transpose(0, 2, 1, 3).reshape(B, T, -1)
        return lay.attn_output(a * mx.sigmoid(lay.attn_gate(h)))

    def __call__(self, tokens: mx.array) -> mx.array:
        """tokens (B, T) from position 0 -> logits (B, T, n_vocab)."""
        g = self.g
        T = tokens.shape[1]
        masks = {True: causal_mask(T, g.sliding_window), False: causal_mask(T, None)}
        x = mx.fast.rms_norm(self.token_embd[tokens], None, g.rms_eps)
        for i, lay in enumerate(self.blk):
            h = mx.fast.rms_norm(x, lay.attn_norm, g.rms_eps)
            x = x + mx.fast.rms_norm(self.attention(i, lay, h, masks), lay.post_attention_norm, POST_NORM_EPS)
            h = mx.fast.rms_norm(x, lay.ffn_norm, g.rms_eps)
            f = lay.ffn_down(nn.silu(lay.ffn_gate(h)) * lay.ffn_up(h))
            x = x + mx.fast.rms_norm(f, lay.post_ffw_norm, POST_NORM_EPS)
        logits = self.output(mx.fast.rms_norm(x, self.output_norm, g.rms_eps)) * g.logit_scale
        c = g.final_logit_softcap
        return mx.tanh(logits / c) * c if c else logits

    def gguf_tensors(self) -> dict[str, mx.array]:
        """The parameters under their GGUF names (blk.0.attn_q.weight, blk.0.attn_norm.weight, ...)."""
        return {name if name.endswith(".weight") else name + ".weight": value
                for name, value in tree_flatten(self.parameters())}

    def load_gguf_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        """The inverse of gguf_tensors: set every parameter from its GGUF-named values."""
        names = dict(tree_flatten(self.parameters()))
        pairs = [(n if n in names else n.removesuffix(".weight"), mx.array(v)) for n, v in tensors.items()]
        self.load_weights(pairs, strict=True)


def loss_fn(model: TinyMuse, batch: mx.array) -> mx.array:
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")


def batches(ids: np.ndarray, cfg: TrainConfig, rng: np.random.Generator, n: int):
    """n random windows of seq_len + 1 ids."""
    starts = rng.integers(0, ids.size - cfg.seq_len - 1, size=(n, cfg.batch))
    for row in starts:
        yield mx.array(np.stack([ids[s:s + cfg.seq_len + 1] for s in row]).astype(np.int32))


def held_out_batches(ids: np.ndarray, cfg: TrainConfig) -> list[mx.array]:
    """Fixed, non-overlapping windows of the held-out stream (the same every evaluation)."""
    n = min(cfg.eval_batches * cfg.batch, (ids.size - 1) // (cfg.seq_len + 1))
    rows = [ids[i * (cfg.seq_len + 1):(i + 1) * (cfg.seq_len + 1)] for i in range(n)]
    return [mx.array(np.stack(rows[a:a + cfg.batch]).astype(np.int32)) for a in range(0, n, cfg.batch)]


def steps_for_budget(model: TinyMuse, train_ids: np.ndarray, cfg: TrainConfig, seconds: float) -> tuple[int, float]:
    """How many steps of cfg fit in `seconds`, from the time of 10 steps after 3 warm-up steps
    on a throw-away copy of the model (the run itself then has a fixed, recorded step count).
    -> (steps, seconds per step)."""
    probe = TinyMuse(model.g)
    probe.update(model.parameters())
    opt = optim.AdamW(learning_rate=cfg.lr)
    state = [probe.state, opt.state]
    grad_fn = nn.value_and_grad(probe, loss_fn)

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(batch):
        loss, grads = grad_fn(probe, batch)
        opt.update(probe, grads)
        return loss

    it = batches(train_ids, cfg, np.random.default_rng(12345), 13)
    for k, batch in enumerate(it):
        if k == 3:
            mx.synchronize()
            t0 = time.perf_counter()
        step_fn(batch)
        mx.eval(state)
    per_step = (time.perf_counter() - t0) / 10
    return max(1, int(seconds / per_step)), per_step


def train(model: TinyMuse, train_ids: np.ndarray, held_ids: np.ndarray, cfg: TrainConfig,
          max_seconds: float = float("inf"), log=print) -> dict:
    """AdamW with linear warm-up and cosine decay; decoupled weight decay on the matrices only;
    the parameters of the best held-out loss are kept. -> the curves and timings."""
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-7, cfg.lr, cfg.warmup),
         optim.cosine_decay(cfg.lr, max(1, cfg.steps - cfg.warmup), cfg.lr * cfg.min_lr_ratio)], [cfg.warmup])
    opt = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.95], weight_decay=0.0)
    state = [model.state, opt.state]
    grad_fn = nn.value_and_grad(model, loss_fn)

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(batch):
        loss, grads = grad_fn(model, batch)
        grads, norm = optim.clip_grad_norm(grads, cfg.grad_clip)
        lr = opt.learning_rate
        opt.update(model, grads)
        decayed = tree_map(lambda p: p * (1 - lr * cfg.weight_decay) if p.ndim == 2 else p, model.parameters())
        model.update(decayed)
        return loss, norm

    eval_fn = mx.compile(lambda b: loss_fn(model, b), inputs=state)
    held = held_out_batches(held_ids, cfg)

    def evaluate() -> float:
        return float(np.mean([eval_fn(b).item() for b in held]))

    rng = np.random.default_rng(cfg.seed)
    curve, held_curve = [], []
    best = (evaluate(), 0, dict(tree_flatten(model.parameters())))
    held_curve.append((0, best[0]))
    t0 = time.perf_counter()
    step, losses = 0, []
    for step, batch in enumerate(batches(train_ids, cfg, rng, cfg.steps), start=1):
        loss, norm = step_fn(batch)
        mx.eval(state)
        losses.append(loss.item())
        if step % cfg.eval_every == 0 or step == cfg.steps:
            held_loss = evaluate()
            held_curve.append((step, held_loss))
            curve.append((step, float(np.mean(losses))))
            losses = []
            if held_loss < best[0]:
                best = (held_loss, step, dict(tree_flatten(model.parameters())))
            log(f"step {step:5d}  train {curve[-1][1]:.4f}  held-out {held_loss:.4f} "
                f"(ppl {math.exp(held_loss):.2f})  {time.perf_counter() - t0:.1f} s")
        if time.perf_counter() - t0 > max_seconds:
            log(f"stopped at step {step}: --max-seconds {max_seconds} reached")
            break
    wall = time.perf_counter() - t0
    model.load_weights(list(best[2].items()))
    return {"steps_run": step, "train_seconds": round(wall, 2), "train_curve": curve, "held_out_curve": held_curve,
            "best_step": best[1], "best_held_out_loss": best[0], "best_held_out_ppl": math.exp(best[0]),
            "tokens_seen": step * cfg.batch * cfg.seq_len}


SHARD_BYTES = 14 * 2**20   # under the device's 16 MiB per returned file


def save_weights(model: TinyMuse, out: Path) -> list[str]:
    """float16 matrices, float32 vectors, in shards of at most SHARD_BYTES; the geometry in each
    shard's metadata."""
    meta = {"geometry": json.dumps(asdict(model.g))}
    shards, current, size = [], {}, 0
    for name, value in sorted(model.gguf_tensors().items()):
        value = value.astype(mx.float16 if value.ndim == 2 else mx.float32)
        if current and size + value.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = value
        size += value.nbytes
    shards.append(current)
    names = []
    for k, shard in enumerate(shards):
        names.append(f"weights-{k:02d}-of-{len(shards):02d}.safetensors")
        mx.save_safetensors(str(out / names[-1]), shard, metadata=meta)
    return names


def load_weights(paths) -> tuple[Geometry, dict[str, np.ndarray]]:
    """The shards save_weights wrote -> (geometry, GGUF name -> float32 numpy)."""
    from safetensors.numpy import load_file
    from safetensors import safe_open

    tensors, geometry = {}, None
    for p in sorted(paths):
        with safe_open(str(p), "numpy") as f:
            g = json.loads(f.metadata()["geometry"])
        g["swa_layers"] = tuple(g["swa_layers"])
        geometry = Geometry(**g)
        tensors.update({k: v.astype(np.float32) for k, v in load_file(str(p)).items()})
    return geometry, tensors


def _command(argv=None) -> int:
    ap = Parser(prog="python -m muse_mlx.tools.tiny_train", description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--batch", type=int, default=TrainConfig.batch)
    ap.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    ap.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--max-seconds", type=float, default=float("inf"), help="stop here whatever the schedule")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds of training: the step count becomes min(--steps, what a timed probe says fits)")
    ap.add_argument("--geometry", default="", help="overrides of the tiny geometry, name=value,... (tests)")
    args = ap.parse_args(argv)
    if min(args.steps, args.batch, args.seq_len, args.eval_every) < 1 or not args.lr > 0:
        raise MuseError("--steps, --batch, --seq-len and --eval-every must be >= 1 and --lr > 0")
    for name in ("train.npy", "heldout.npy"):
        if not (args.data / name).is_file():
            raise MuseError(f"{args.data / name} is missing: make it with python -m muse_mlx.tools.tiny_data")
    cfg = TrainConfig(seq_len=args.seq_len, batch=args.batch, steps=args.steps, eval_every=args.eval_every,
                      lr=args.lr, warmup=min(TrainConfig.warmup, max(1, args.steps // 10)))
    g = TINY_GEOMETRY
    if args.geometry:
        g = g.with_(**{k: type(getattr(g, k))(v) for k, v in (kv.split("=") for kv in args.geometry.split(","))})
    args.out.mkdir(parents=True, exist_ok=True)
    train_ids, held_ids = np.load(args.data / "train.npy"), np.load(args.data / "heldout.npy")
    mx.random.seed(cfg.seed)
    model = TinyMuse(g)
    mx.eval(model.parameters())
    probe = None
    if args.time_budget > 0:
        steps, per_step = steps_for_budget(model, train_ids, cfg, args.time_budget)
        probe = {"seconds_per_step": per_step, "steps_that_fit": steps, "time_budget": args.time_budget}
        print(f"probe: {per_step * 1e3:.1f} ms per step; {steps} steps fit in {args.time_budget} s", flush=True)
        cfg = replace(cfg, steps=min(cfg.steps, steps), warmup=min(cfg.warmup, max(1, min(cfg.steps, steps) // 10)))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"{n_params:,} parameters; {train_ids.size:,} training tokens, {held_ids.size:,} held out; "
          f"device {mx.default_device()}", flush=True)
    result = train(model, train_ids, held_ids, cfg, args.max_seconds, log=lambda s: print(s, flush=True))
    shards = save_weights(model, args.out)
    curves = {k: result.pop(k) for k in ("train_curve", "held_out_curve")}
    receipt = make_receipt(
        "tiny-train",
        inputs={"geometry": asdict(g), "config": asdict(cfg), "n_params": n_params,
                "train_tokens": int(train_ids.size), "held_out_tokens": int(held_ids.size),
                "probe": probe, "data_sha256": {s: hashlib.sha256(np.load(args.data / f"{s}.npy").tobytes()).hexdigest()
                                for s in ("train", "heldout")}, "max_seconds": None if math.isinf(args.max_seconds) else args.max_seconds},
        metrics={**result, "weights": shards}, samples=curves,
        notes=["losses are mean cross-entropy in nats per token of the tiny tokenizer; the held-out "
               "curve is over fixed windows of the held-out pages"])
    write_receipt(args.out / "train-receipt.json", receipt)
    print(f"best held-out loss {result['best_held_out_loss']:.4f} (ppl {result['best_held_out_ppl']:.2f}) "
          f"at step {result['best_step']}; {result['train_seconds']} s", flush=True)
    return 0


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
