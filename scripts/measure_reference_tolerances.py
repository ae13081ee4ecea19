"""Measure the engine's reference path against the independent float64 forward pass (tests/reference.py)
on the default synthetic fixture, and write a receipt (receipts/reference/float64.json).

These are the numbers the tolerances in tests/test_model.py are set against.
Usage: python scripts/measure_reference_tolerances.py
"""
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from gguf import GGMLQuantizationType as QT  # noqa: E402

from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, ensure_fixture, kquant_mix, write_random_blocks  # noqa: E402
from muse_mlx.model import load  # noqa: E402
from muse_mlx.tools.parity import logit_metrics  # noqa: E402
from muse_mlx.tools.receipts import file_sha256, make_receipt, write_receipt  # noqa: E402
from reference import ReferenceModel  # noqa: E402

g = DEFAULT_GEOMETRY
path = ensure_fixture()
work = Path(ensure_fixture().parent)
# The ill-conditioned random-block fixtures tests/gpu also uses (logits of std 10-19).
files = {
    "default-f32": path,
    "random-q4_k_m": write_random_blocks(work / "random-q4_k_m-s3.gguf", g, kquant_mix(g), seed=3),
    "random-nvfp4": write_random_blocks(work / "random-nvfp4-s4.gguf", g,
                                        {k: (QT.NVFP4 if len(s) == 2 else QT.F32) for k, s in g.tensor_shapes().items()},
                                        seed=4),
}
n = 3 * g.sliding_window + 20
tokens = np.random.default_rng(1).integers(0, g.n_vocab, n)
metrics = {}
for fixture, fpath in files.items():
    for name, kv_dtype, kv_f16 in (("f32_kv", mx.float32, False), ("f16_kv", mx.float16, True)):
        model = load(fpath, use_kernels=False)
        cache = model.make_cache(n, dtype=kv_dtype)
        ours = np.array(model.prefill(mx.array(tokens), cache, all_logits=True))
        ref = ReferenceModel(fpath, kv_f16=kv_f16).logits(tokens)
        metrics[f"{fixture}/{name}"] = dict(logit_metrics(ours, ref), logit_std=float(ref.std()))
        print(fixture, name, {k: f"{v:.3g}" for k, v in metrics[f"{fixture}/{name}"].items()})
receipt = make_receipt("reference/float64", synthetic=True,
                       inputs={"models": {k: str(v) for k, v in files.items()},
                               "sha256": {k: file_sha256(v) for k, v in files.items()}, "tokens": n, "seed": 1},
                       metrics=metrics, notes="MLX-ops reference path (CPU) vs tests/reference.py (float64)")
print("receipt:", write_receipt(root / "receipts/reference/float64.json", receipt))
