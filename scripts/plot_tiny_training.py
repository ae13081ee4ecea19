"""Plot tiny-model training receipts (tools/tiny_train.py): train and held-out loss per step.

    python scripts/plot_tiny_training.py OUT.png RECEIPT.json [RECEIPT.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(png: str, *receipts: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for i, path in enumerate(receipts):
        r = json.loads(Path(path).read_text())
        steps = r["inputs"]["config"]["steps"]
        rev = (r["git"].get("revision") or "?")[:7]
        for key, style, label in (("train_curve", "--", "train"), ("held_out_curve", "-", "held-out")):
            xs, ys = zip(*r["samples"][key])
            ax.plot(xs, ys, style, label=f"{label}, {steps} steps ({rev})")
        best = r["metrics"]
        ax.annotate(f"best held-out ppl {best['best_held_out_ppl']:.1f}", (best["best_step"], best["best_held_out_loss"]),
                    textcoords="offset points", xytext=(5, -14 - 12 * i), fontsize=8)
    ax.set_xlabel("step (32 x 512 tokens)")
    ax.set_ylabel("cross-entropy, nats per token")
    ax.set_ylim(0, 8.5)
    ax.set_title("tiny muse-glimmer on the Python 3.11 docs, H200")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
