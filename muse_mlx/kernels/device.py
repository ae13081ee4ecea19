"""Which GPU MLX can use here, and the properties of it that launch planning needs."""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

# Threadgroups a Metal grid is planned for when nothing better is known (Apple GPUs report no
# core count to MLX; this value has not been measured on Apple hardware in this project).
METAL_PLANNING_CORES = 64

# Threadgroup memory one Metal threadgroup may declare (Apple GPUs: 32 KB).
METAL_GROUP_MEMORY = 32768


@dataclass(frozen=True)
class Device:
    """backend: 'metal' or 'cuda'; cores: multiprocessors (CUDA, from the driver) or the
    planning value for Metal; group_memory: the bytes of threadgroup memory one threadgroup
    may use (CUDA: the driver's opt-in maximum, which MLX enables past 48 KB)."""

    backend: str
    cores: int
    group_memory: int = METAL_GROUP_MEMORY
    capability: tuple[int, int] = (0, 0)   # CUDA compute capability (major, minor); (0, 0) on Metal


@lru_cache(maxsize=None)
def gpu_backend() -> str | None:
    """'metal', 'cuda', or None when MLX has no GPU here (the answer does not change within a process)."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


@lru_cache(maxsize=None)
def gpu_device() -> Device | None:
    """The GPU's Device, or None without one."""
    backend = gpu_backend()
    if backend is None:
        return None
    if backend == "cuda":
        return Device("cuda", cuda_attribute(CU_MULTIPROCESSOR_COUNT), cuda_attribute(CU_MAX_SHARED_PER_BLOCK_OPTIN),
                      (cuda_attribute(CU_CAPABILITY_MAJOR), cuda_attribute(CU_CAPABILITY_MINOR)))
    return Device("metal", METAL_PLANNING_CORES)


CU_MULTIPROCESSOR_COUNT = 16            # CUdevice_attribute values (cuda.h)
CU_MAX_SHARED_PER_BLOCK_OPTIN = 97
CU_CAPABILITY_MAJOR, CU_CAPABILITY_MINOR = 75, 76


CUDA_DRIVER_SONAME = "libcuda.so.1"


def load_cuda_driver() -> ctypes.CDLL:
    """The CUDA driver library (a new handle: callers set their own signatures). By its soname
    first, which the dynamic loader resolves at once; ctypes.util.find_library (which runs
    ldconfig in a subprocess, 2-3 ms on the H200's host) only where that fails."""
    try:
        return ctypes.CDLL(CUDA_DRIVER_SONAME)
    except OSError as exc:
        name = ctypes.util.find_library("cuda")
        if name is None:
            raise OSError(f"the CUDA driver library ({CUDA_DRIVER_SONAME}) does not load: {exc}") from None
        return ctypes.CDLL(name)


@lru_cache(maxsize=None)
def _attribute_driver() -> ctypes.CDLL:
    return load_cuda_driver()


def cuda_attribute(attribute: int, device_index: int = 0) -> int:
    """An attribute of a CUDA device from the driver API (libcuda, which every machine that
    runs CUDA has): MLX's device_info reports neither the multiprocessors nor the shared memory."""
    try:
        lib = _attribute_driver()
    except OSError as exc:
        raise RuntimeError(f"MLX reports a CUDA device but {exc}") from None
    count, dev = ctypes.c_int(0), ctypes.c_int(0)
    for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), device_index)),
                       ("cuDeviceGetAttribute", (ctypes.byref(count), attribute, dev))):
        status = getattr(lib, call)(*args)
        if status != 0:
            raise RuntimeError(f"the CUDA driver's {call} failed with status {status}")
    return count.value
