"""Ops backends: how the forward's steps are computed, chosen once when a model is loaded.

The forward pass (model.py) is written once; where computing a step on the GPU differs from
MLX ops (raw-block products, fused glue, split decode attention), it asks its ops backend:

- `ReferenceOps` (ops/reference.py): MLX ops in float32 over weights dequantized at load; the
  exactness path, and the only one on the CPU.
- `GpuOps` (ops/gpu.py): the custom kernels over the GGUF's raw blocks for the small-row steps
  (at most kernels.MAX_BATCH token rows: decode over 1..4 slots, a verify step), the
  reference's MLX ops for longer chunks (prefill).

`select_ops(backend, config)` makes one from a name: 'auto' (the GPU when MLX has one),
'gpu' or 'reference'.
"""

from __future__ import annotations

from ..config import BACKENDS, KernelConfig
from ..errors import MuseError
from .reference import ReferenceOps, Slice


def select_ops(backend: str = "auto", config: KernelConfig = KernelConfig(), kernel_cache: bool = True) -> ReferenceOps:
    """kernel_cache: on CUDA, compile our kernels into MLX's disk cache (kernels/disk_cache.py) so
    that the next process loads them instead of compiling (where NVRTC is found; else MLX compiles
    them as without it). Its modules give bitwise MLX's own compiles' outputs (tests/gpu,
    receipts/kernels/h200-3dcc931-verification-disk-cache-bitwise.json)."""
    from ..kernels import Kernels, gpu_device

    if backend not in BACKENDS:
        raise MuseError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    device = gpu_device() if backend != "reference" else None
    if device is None:
        if backend == "gpu":
            raise MuseError("the GPU backend needs a Metal or CUDA device, and MLX has none here")
        return ReferenceOps()
    from .gpu import GpuOps

    disk_cache = None
    if kernel_cache and device.backend == "cuda":
        from ..kernels.disk_cache import KernelCache, Nvrtc, default_dir

        nvrtc = Nvrtc.find(device.capability)
        disk_cache = KernelCache(default_dir(), nvrtc) if nvrtc is not None else None
    return GpuOps(Kernels(device, config, disk_cache=disk_cache))


__all__ = ["ReferenceOps", "Slice", "select_ops"]
