"""muse_mlx: an MLX reimplementation of the Muser inference engine for Muse Glimmer."""

import os as _os

# Exactness first: cuBLAS must not run float32 GEMMs (the kernel path's prefill) in TF32,
# whose 10-bit mantissa moved log-probabilities by ~1e-2 on the H200. Set before MLX's CUDA
# backend creates its cuBLAS handle; a user's own setting wins. Metal and CPU ignore it.
_os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

__version__ = "0.1.0"
