"""Host bytes to device memory through page-locked staging (CUDA; docs/kernels.md, "Upload").

MLX 0.32's CUDA backend moves host bytes to the GPU two ways, both slow for gigabytes:
`mx.array(numpy)` writes them into managed memory (host page faults, ~2 GB/s on the H200's host,
then a migration at the GPU's first read), and `mx.load` reads each tensor into a buffer it
mallocs and copies that with a pageable cudaMemcpy (~3.3 GB/s in 16 MiB pieces; docs/ledger.md,
2026-12-02).

`PinnedUpload` reads the bytes (on threads, from files) into page-locked host memory that the
GPU maps (the driver's cuMemHostAlloc with DEVICEMAP), lets a check look at them there, and
launches a kernel (custom_kernels/upload_cuda.inc) that copies them into a new MLX array: the
GPU pulls them over the host link while the threads read the next pieces. What a check saw is
what the GPU copies: the staging is not written again until the copies out of it have been
evaluated.

The staging is one buffer per process, allocated at its first use and kept, used in two halves:
the threads fill one while the copies out of the other run. On Apple silicon MLX's arrays live in
memory the host and the GPU share, so there is nothing to stage (no Metal twin).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable

import mlx.core as mx

HALF_BYTES = 128 * 2**20    # one half of the staging, and the largest piece one upload takes
READ_THREADS = min(8, os.cpu_count() or 1)
ALIGN = 256                 # pieces start at multiples of this in the staging
GROUP = 256                 # threads of a copy's threadgroup (16 bytes each a pass)
MAX_GROUPS = 2048
CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_DEVICEMAP = 0x01, 0x02


@dataclass(frozen=True)
class Piece:
    """`size` bytes of the file `path`, from `offset`."""

    path: Path
    offset: int
    size: int


# A check: (the piece's index, its bytes as a read-only memoryview) -> (start, nbytes), the span of
# them to copy to the device. It refuses a piece by raising; it runs on a reading thread.
Check = Callable[[int, memoryview], tuple[int, int]]


def _whole(_: int, view: memoryview) -> tuple[int, int]:
    return 0, len(view)


@lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    """libcuda with the signatures of the calls used here (64-bit pointers need them)."""
    from .device import load_cuda_driver
    lib = load_cuda_driver()
    ptr, uint = ctypes.c_void_p, ctypes.c_uint
    signatures = {
        "cuInit": [uint],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ptr), ctypes.c_int],
        "cuCtxPushCurrent_v2": [ptr],
        "cuCtxPopCurrent_v2": [ctypes.POINTER(ptr)],
        "cuMemHostAlloc": [ctypes.POINTER(ptr), ctypes.c_size_t, uint],
        "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(ctypes.c_uint64), ptr, uint],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _call(lib: ctypes.CDLL, name: str, *args) -> None:
    status = getattr(lib, name)(*args)
    if status != 0:
        raise RuntimeError(f"the CUDA driver's {name} failed with status {status}")


class Staging:
    """`nbytes` of page-locked host memory that device 0 maps, in the device's primary context (the
    one MLX's runtime uses): `view`, the host's memoryview of it, and `device_address`, the GPU's."""

    def __init__(self, nbytes: int):
        lib = _driver()
        dev, ctx, host, old = ctypes.c_int(0), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        device = ctypes.c_uint64(0)
        _call(lib, "cuInit", 0)
        _call(lib, "cuDeviceGet", ctypes.byref(dev), 0)
        _call(lib, "cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        _call(lib, "cuCtxPushCurrent_v2", ctx)
        try:
            _call(lib, "cuMemHostAlloc", ctypes.byref(host), nbytes,
                  CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP)
            _call(lib, "cuMemHostGetDevicePointer_v2", ctypes.byref(device), host, 0)
        finally:
            _call(lib, "cuCtxPopCurrent_v2", ctypes.byref(old))
        self.nbytes, self.device_address = nbytes, device.value
        self.view = memoryview((ctypes.c_uint8 * nbytes).from_address(host.value)).cast("B")


def copy_source() -> str:
    """The copy kernel's body (custom_kernels/upload_cuda.inc), comments and indentation dropped."""
    text = resources.files("custom_kernels").joinpath("upload_cuda.inc").read_text(encoding="utf-8")
    return "".join(ln.strip() + "\n" for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("//"))


@lru_cache(maxsize=None)
def _copy_kernel():
    return mx.fast.cuda_kernel(name="muse_upload", input_names=["meta"], output_names=["out"], source=copy_source())


def note_copy_kernel(disk_cache) -> None:
    """Have a kernels.disk_cache.KernelCache compile the copy kernel into MLX's disk cache now (a
    later process loads it instead of compiling it at its first upload)."""
    disk_cache.note("muse_upload", "", copy_source(), ["meta"], [mx.zeros((2,), mx.uint64)], ["out"], [mx.uint8], [])
    disk_cache.ready()


def _read(path: Path, offset: int, into: memoryview) -> None:
    """Fill `into` with the bytes of `path` from `offset` (OSError when the file ends first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(into):
            n = os.preadv(fd, [into[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{path} ends at byte {offset + done:,}, before {offset + len(into):,}")
            done += n
    finally:
        os.close(fd)


class PinnedUpload:
    """Pieces of files onto the device through the process's page-locked staging (module doc)."""

    def __init__(self, half_bytes: int = HALF_BYTES, threads: int = READ_THREADS):
        self.half_bytes, self.threads = half_bytes, threads
        self._staging: Staging | None = None
        self._lock = threading.Lock()

    def upload(self, pieces: list[Piece], check: Check | None = None) -> list[mx.array]:
        """Each piece's bytes (or the span `check` returns of them) as a uint8 MLX array in device
        memory, evaluated. A piece is at most `half_bytes`. When a read fails or a check refuses,
        that error is raised after the copies already started have finished."""
        for p in pieces:
            if p.size > self.half_bytes:
                raise ValueError(f"a piece of {p.size:,} bytes is larger than the staging's half ({self.half_bytes:,})")
        check = check or _whole
        with self._lock:
            if self._staging is None:
                self._staging = self._allocate(2 * self.half_bytes)
            batches = self._batches(pieces)
            out: list[mx.array | None] = [None] * len(pieces)
            pending: list[list[mx.array]] = [[], []]   # the copies out of each half, not yet waited for
            with ThreadPoolExecutor(max_workers=self.threads) as pool:

                def submit(k: int) -> list:
                    """Batch k's reads, once the copies out of its half (batch k - 2's) are done."""
                    half, batch = batches[k]
                    if pending[half]:
                        mx.eval(pending[half])
                        pending[half] = []
                    return [pool.submit(self._read_checked, pieces[j], j, at, check) for j, at in batch]
                try:
                    futures = submit(0) if batches else []
                    for k, (half, batch) in enumerate(batches):
                        following = submit(k + 1) if k + 1 < len(batches) else []   # read while these copy
                        for (j, at), future in zip(batch, futures):
                            start, nbytes = future.result()
                            out[j] = self._copy(at + start, nbytes)
                            pending[half].append(out[j])
                            mx.async_eval(out[j])
                        futures = following
                finally:
                    mx.eval(pending[0] + pending[1])
        return out

    def _batches(self, pieces: list[Piece]) -> list[tuple[int, list[tuple[int, int]]]]:
        """The pieces in consecutive batches that fill the halves in turn: (half, [(piece index,
        its byte offset in the staging)])."""
        batches, half, i = [], 0, 0
        while i < len(pieces):
            batch, used = [], 0
            while i < len(pieces) and used + pieces[i].size <= self.half_bytes:
                batch.append((i, half * self.half_bytes + used))
                used += -(-pieces[i].size // ALIGN) * ALIGN
                i += 1
            batches.append((half, batch))
            half ^= 1
        return batches

    def _allocate(self, nbytes: int) -> Staging:
        return Staging(nbytes)

    def _read_checked(self, piece: Piece, index: int, at: int, check: Check) -> tuple[int, int]:
        view = self._staging.view[at:at + piece.size]
        _read(piece.path, piece.offset, view)
        start, nbytes = check(index, view.toreadonly())
        if not (0 <= start and 0 <= nbytes and start + nbytes <= piece.size):
            raise ValueError(f"a check returned the span {start}+{nbytes} of a {piece.size}-byte piece")
        return start, nbytes

    def _copy(self, at: int, nbytes: int) -> mx.array:
        if nbytes == 0:
            return mx.zeros((0,), mx.uint8)
        meta = mx.array([self._staging.device_address + at, nbytes], dtype=mx.uint64)
        groups = max(1, min(MAX_GROUPS, -(-nbytes // (16 * GROUP))))
        return _copy_kernel()(inputs=[meta], output_shapes=[(nbytes,)], output_dtypes=[mx.uint8],
                              grid=(groups * GROUP, 1, 1), threadgroup=(GROUP, 1, 1), stream=mx.gpu)[0]


@lru_cache(maxsize=None)
def pinned_upload() -> PinnedUpload | None:
    """The process's PinnedUpload (one staging for every caller), its staging allocated now; None,
    with a warning, where the driver does not give page-locked mapped memory (mx.load's way then)."""
    up = PinnedUpload()
    try:
        up._staging = up._allocate(2 * up.half_bytes)
    except (OSError, RuntimeError, AttributeError) as exc:
        print(f"warning: no page-locked staging ({exc}); host bytes go to the GPU through mx.load", file=sys.stderr)
        return None
    return up
