"""The tiny model's parity verdict per lane (docs/tiny-model.md): perplexity on the first CHUNKS
chunks of 512 of its held-out pages by the engine (MLX-ops reference, float32), the pinned
llama.cpp (CPU, through the parity binding) and the float64 oracle (tests/reference.py) on the
same tokens; and the KL divergence of each quantized lane from F16, by the engine.

    python tests/tiny_verdict.py LANES_DIR RECEIPT.json   # LANES_DIR: muse-glimmer-tiny-{f16,q8_0,q4_k_m}.gguf
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from reference import ReferenceModel, log_softmax as log_softmax64  # noqa: E402

from muse_mlx.default_model import held_out_text_path  # noqa: E402
from muse_mlx.model import load  # noqa: E402
from muse_mlx.perplexity import chunks  # noqa: E402
from muse_mlx.sampling import log_softmax  # noqa: E402
from muse_mlx.tokenizer import MuseTokenizer  # noqa: E402
from muse_mlx.tools.llamacpp import LlamaCpp  # noqa: E402
from muse_mlx.tools.receipts import file_sha256, make_receipt, write_receipt  # noqa: E402

CTX, CHUNKS = 512, 4
LANES = ("f16", "q8_0", "q4_k_m")


def main(lanes_dir: str, out: str) -> None:
    lanes_dir = Path(lanes_dir)
    text = held_out_text_path().read_text(encoding="utf-8")
    results, logprobs = {}, {}
    for lane in LANES:
        path = lanes_dir / f"muse-glimmer-tiny-{lane}.gguf"
        model = load(path, backend="reference")
        tok = MuseTokenizer(model.artifact.vocabulary)
        tokens = tok.encode(text)
        oracle = ReferenceModel(str(path))
        nll = {"engine": [], "llama.cpp": [], "float64 oracle": []}
        lps = []
        t0 = time.perf_counter()
        with LlamaCpp(path, n_ctx=CTX) as llama:
            for s, e, first in chunks(len(tokens), CTX, None)[:CHUNKS]:
                ids = list(tokens[s:e])
                ids[0] = tok.bos_id
                targets = np.array(ids[first + 1:])
                for who, lp in (("engine", log_softmax(np.array(model.prefill(ids, model.make_cache(CTX), all_logits=True)))),
                                ("llama.cpp", log_softmax(llama.teacher_forced(ids, len(ids)))),
                                ("float64 oracle", log_softmax64(oracle.logits(ids)))):
                    rows = lp[first:len(ids) - 1]
                    nll[who] += list(-rows[np.arange(len(targets)), targets])
                    if who == "engine":
                        lps.append(rows)
        logprobs[lane] = np.concatenate(lps)
        mean = {k: float(np.mean(v)) for k, v in nll.items()}
        results[lane] = {"file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size,
                         "scored_tokens": len(nll["engine"]),
                         "ppl": {k: math.exp(v) for k, v in mean.items()}, "mean_nll": mean,
                         "engine_minus_oracle_nll": mean["engine"] - mean["float64 oracle"],
                         "llama_minus_oracle_nll": mean["llama.cpp"] - mean["float64 oracle"],
                         "max_abs_token_nll_engine_vs_oracle": float(np.max(np.abs(
                             np.array(nll["engine"]) - np.array(nll["float64 oracle"])))),
                         "max_abs_token_nll_llama_vs_oracle": float(np.max(np.abs(
                             np.array(nll["llama.cpp"]) - np.array(nll["float64 oracle"])))),
                         "seconds": time.perf_counter() - t0}
        print(lane, results[lane]["ppl"], flush=True)
    base = logprobs["f16"]
    for lane in LANES[1:]:
        lp = logprobs[lane]
        kl = (np.exp(base) * (base - lp)).sum(-1)
        results[lane]["kl_from_f16"] = {"mean": float(kl.mean()), "max": float(kl.max()),
                                        "top1_agreement": float(np.mean(base.argmax(-1) == lp.argmax(-1)))}
        print(lane, results[lane]["kl_from_f16"], flush=True)
    receipt = make_receipt("parity/tiny-verdict", inputs={"lanes_dir": str(lanes_dir), "ctx": CTX, "chunks": CHUNKS,
                                                          "text": "muse_mlx/data/tiny-heldout.txt"},
                           metrics=results)
    write_receipt(out, receipt)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
