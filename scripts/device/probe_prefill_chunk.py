"""Where a whole prefill chunk's time goes: the model's own forward, timed with parts taken out.

    python3 scripts/device/probe_prefill_chunk.py BENCH.gguf OUT.json

On the f16 lane (the defaults), for one prompt of 512 tokens at depth 0 (and 2,048):
  - as it runs, each layer's host time (from the last layer's completion to its submission)
    and its wait (submission to completion), from GpuOps.end_layer;
  - "no waits": every layer submitted without waiting (the whole chunk queued; its f16
    weights all exist at once, which fits the H200), so the host and the GPU overlap fully;
  - "w16 kept": each matrix's f16 values made once and kept (55 GB) -> the chunk without
    the dequantization;
  - "unscaled": f16_product without x's power-of-two scaling (x rounded to f16 as is);
  - "chunk 2048": the 2,048-token prompt in one chunk instead of four.
Differences against the plain run place the time. Each: one warm-up, then the median of 3.
Synthetic weights (the bench file's); research only, nothing here is a lane of the engine.
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
import numpy as np


def main() -> int:
    from muse_mlx.artifact import open_artifact
    from muse_mlx.model import Model
    from muse_mlx.ops import gpu, select_ops
    from muse_mlx.tools.receipts import make_receipt, write_receipt

    path, out = sys.argv[1], sys.argv[2]
    model = Model(open_artifact(path), select_ops("gpu"))
    ops = model.ops
    rng = np.random.default_rng(0)

    def run(length: int, chunk: int = 512, reps: int = 3) -> dict:
        tokens = mx.array(rng.integers(0, model.geometry.n_vocab, length))
        samples = []
        for r in range(reps + 1):
            cache = model.make_cache(length + 1)
            t = time.perf_counter()
            mx.eval(model.prefill(tokens, cache, chunk=chunk))
            if r:
                samples.append((time.perf_counter() - t) * 1e3)
        return {"length": length, "chunk": chunk, "median_ms": statistics.median(samples), "samples_ms": samples,
                "tok_s": length / statistics.median(samples) * 1e3}

    cells = {}

    def record(name: str, cell: dict) -> None:
        cells[name] = cell
        print(f"{name:28s} {cell['length']:5d} tokens, chunk {cell['chunk']:5d}: {cell['median_ms']:8.1f} ms "
              f"({cell['tok_s']:7.1f} tok/s)", flush=True)

    record("plain 512", run(512))
    record("plain 2048", run(2048))

    # per layer: host build time and wait, from end_layer
    stamps = []
    plain_end = gpu.GpuOps.end_layer

    def timed_end(self, kv, i, *arrays):
        t0 = time.perf_counter()
        plain_end(self, kv, i, *arrays)
        stamps.append((i, t0, time.perf_counter()))
    gpu.GpuOps.end_layer = timed_end
    tokens = mx.array(rng.integers(0, model.geometry.n_vocab, 512))
    layers = []
    for _ in range(2):
        stamps.clear()
        cache = model.make_cache(513)
        start = time.perf_counter()
        mx.eval(model.prefill(tokens, cache))
        end = time.perf_counter()
        before = start
        layers = []
        for i, submit, done in stamps:
            layers.append({"layer": i, "host_ms": (submit - before) * 1e3, "wait_ms": (done - submit) * 1e3})
            before = done
        tail_ms = (end - before) * 1e3
    gpu.GpuOps.end_layer = plain_end
    host = sum(c["host_ms"] for c in layers)
    wait = sum(c["wait_ms"] for c in layers)
    print(f"per layer (512): host {host:.1f} ms, waits {wait:.1f} ms, after the last layer {tail_ms:.1f} ms; "
          f"layer 1 host {layers[1]['host_ms']:.2f} wait {layers[1]['wait_ms']:.2f}", flush=True)

    def queued_end(self, kv, i, *arrays):
        if self._dequantized:
            self.kernels.ready()
            mx.async_eval(*arrays, *kv.layer_state(i))
            self._dequantized = False
    gpu.GpuOps.end_layer = queued_end
    record("no waits 512", run(512))
    record("no waits 2048", run(2048))
    gpu.GpuOps.end_layer = plain_end

    plain_product = gpu.f16_product
    gpu.f16_product = lambda x, w16, l1: (x.astype(mx.float16) @ w16.T).astype(mx.float32)
    record("unscaled 512", run(512))
    gpu.f16_product = plain_product

    kept: dict[int, mx.array] = {}
    plain_weights = gpu.GpuOps.weights_f16

    def kept_weights(self, w):
        key = id(w.data)
        if key not in kept:
            kept[key] = plain_weights(self, w)
            mx.eval(kept[key])
        return kept[key]
    gpu.GpuOps.weights_f16 = kept_weights
    record("w16 kept 512", run(512))
    record("w16 kept 2048", run(2048))
    gpu.GpuOps.end_layer = queued_end
    record("w16 kept, no waits 512", run(512))
    gpu.GpuOps.end_layer = plain_end
    gpu.GpuOps.weights_f16 = plain_weights
    kept.clear()
    mx.clear_cache()

    record("chunk 2048", run(2048, chunk=2048))
    write_receipt(out, make_receipt("research/prefill-chunk-probe", inputs={"model": path},
                                    metrics={"cells": cells, "layers_512": layers, "after_last_layer_ms": tail_ms},
                                    synthetic=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
