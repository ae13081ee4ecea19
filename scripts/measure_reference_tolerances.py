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

from muse_mlx.fixtures import DEFAULT_GEOMETRY, ensure_fixture  # noqa: E402
from muse_mlx.model import load  # noqa: E402
from muse_mlx.parity import logit_metrics  # noqa: E402
from muse_mlx.receipts import file_sha256, make_receipt, write_receipt  # noqa: E402
from reference import ReferenceModel  # noqa: E402

path = ensure_fixture()
n = 3 * DEFAULT_GEOMETRY.sliding_window + 20
tokens = np.random.default_rng(1).integers(0, DEFAULT_GEOMETRY.n_vocab, n)
metrics = {}
for name, kv_dtype, kv_f16 in (("f32_kv", mx.float32, False), ("f16_kv", mx.float16, True)):
    model = load(path, use_kernels=False)
    cache = model.make_cache(n, dtype=kv_dtype)
    ours = np.array(model.prefill(mx.array(tokens), cache, all_logits=True))
    metrics[name] = logit_metrics(ours, ReferenceModel(path, kv_f16=kv_f16).logits(tokens))
    print(name, {k: f"{v:.3g}" for k, v in metrics[name].items()})
receipt = make_receipt("reference/float64", synthetic=True,
                       inputs={"model": str(path), "model_sha256": file_sha256(path), "tokens": n, "seed": 1},
                       metrics=metrics, notes="MLX-ops reference path (CPU) vs tests/reference.py (float64)")
print("receipt:", write_receipt(root / "receipts/reference/float64.json", receipt))
