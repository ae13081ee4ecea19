"""The GPU kernel path: kernel text (source), launch planning (plan), launches (launch), and the
device they run on (device). The model reaches them through ops/gpu.py."""

from .device import Device, gpu_backend, gpu_device
from .launch import Kernels
from .plan import MAX_BATCH

__all__ = ["Device", "Kernels", "MAX_BATCH", "gpu_backend", "gpu_device"]
