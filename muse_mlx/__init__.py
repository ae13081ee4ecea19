"""muse_mlx: an MLX reimplementation of the Muser inference engine for Muse Glimmer."""

import os as _os

# Exactness first: cuBLAS must not run float32 GEMMs (the kernel path's prefill) in TF32,
# whose 10-bit mantissa moved log-probabilities by ~1e-2 on the H200. Set before MLX's CUDA
# backend creates its cuBLAS handle; a user's own setting wins. Metal and CPU ignore it.
_os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
# MLX's own switch for the same (its CUDA backend asks cuBLAS for TF32 float32 GEMMs unless
# MLX_ENABLE_TF32=0, read once at its first float32 product): both, so that float32 stays
# float32 whichever of the two a given driver and MLX honour.
_os.environ.setdefault("MLX_ENABLE_TF32", "0")

__version__ = "0.1.0"
