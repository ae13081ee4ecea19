"""Raw tensors into MLX by MLX's own loader, straight from the GGUF file.

`mx.array(numpy)` copies host bytes into memory MLX allocates for the host: on CUDA, managed
memory, whose every page the host's first write faults in (~2 GB/s on the H200's host) and the
GPU's first read migrates again. `mx.load` instead reads a tensor into a host buffer and copies
it to device memory (`Load::eval_gpu`), and it takes any file-like object. So a set of raw
tensors is presented to it as a safetensors stream: a header naming each as a U8
(rows, row_bytes) tensor, then their bytes, served from the GGUF file at their offsets
(`os.preadv`, one read per tensor). Nothing is copied until the arrays are evaluated, and then
once. On the CPU and Metal backends it is one copy from the file, as `mx.array` was.
"""

from __future__ import annotations

import bisect
import io
import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from .artifact import RawTensor


class TensorStream(io.RawIOBase):
    """A read-only safetensors stream of `raws` (all from the file `path`, in order)."""

    def __init__(self, path: Path, raws: list[RawTensor]):
        super().__init__()
        header, spans, at = {}, [], 0
        for i, r in enumerate(raws):
            nbytes = r.data.nbytes
            header[str(i)] = {"dtype": "U8", "shape": list(r.data.shape), "data_offsets": [at, at + nbytes]}
            spans.append((at, nbytes, r.offset))
            at += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._head = len(text).to_bytes(8, "little") + text
        self._starts = [s[0] for s in spans]
        self._spans = spans
        self._size = len(self._head) + at
        self._pos = 0
        self._fd = os.open(path, os.O_RDONLY)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._pos < self._size:
            if self._pos < len(self._head):
                piece = self._head[self._pos:self._pos + len(out) - done]
                out[done:done + len(piece)] = piece
                n = len(piece)
            else:
                at = self._pos - len(self._head)
                i = bisect.bisect_right(self._starts, at) - 1
                first, nbytes, file_offset = self._spans[i]
                want = min(len(out) - done, first + nbytes - at)
                n = os.preadv(self._fd, [out[done:done + want]], file_offset + at - first)
                if n <= 0:
                    break
            done += n
            self._pos += n
        return done

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def load_raw(raws: list[RawTensor]) -> list[mx.array]:
    """Each raw tensor's (rows, row_bytes) uint8 bytes as an MLX array (lazy: read when evaluated).
    Tensors mapped from a file go through mx.load of a TensorStream over it; others are copied."""
    out: list[mx.array | None] = [None] * len(raws)
    by_file: dict[Path, list[int]] = {}
    for i, r in enumerate(raws):
        if r.path is not None and r.offset is not None:
            by_file.setdefault(r.path, []).append(i)
        else:
            out[i] = mx.array(np.ascontiguousarray(r.data))
    for path, idx in by_file.items():
        loaded = mx.load(TensorStream(path, [raws[i] for i in idx]), format="safetensors")
        for j, i in enumerate(idx):
            out[i] = loaded[str(j)]
    return out
