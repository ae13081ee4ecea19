"""Measure the engine's reference path against the independent float64 forward pass (tests/reference.py)
on the default synthetic fixture and two ill-conditioned random-block fixtures, and write a
receipt (receipts/reference/float64.json).

These are the numbers the tolerances in tests/test_model.py are set against. A tool beside the
test oracle, not a test (pytest collects only test_*.py): run from the repository root with the
package installed (pip install -e .) as

    python tests/measure_reference_tolerances.py

Python puts the script's folder, tests/, first on the import path, so `reference` is the oracle
the tests import.
"""
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
from reference import ReferenceModel

from muse_mlx.model import load
from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, ensure_fixture, kquant_mix, write_random_blocks
from muse_mlx.tools.parity import logit_metrics
from muse_mlx.tools.receipts import file_sha256, make_receipt, write_receipt

root = Path(__file__).resolve().parents[1]
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
        model = load(fpath, backend="reference")
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
