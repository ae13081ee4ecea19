"""Kernel sources for mx.fast.metal_kernel and mx.fast.cuda_kernel (read by muse_mlx/kernels.py)."""
