"""Raw tensors into MLX by MLX's own loader, straight from the GGUF file.

`mx.array(numpy)` copies host bytes into memory MLX allocates for the host: on CUDA, managed
memory, whose every page the host's first write faults in (~2 GB/s on the H200's host) and the
GPU's first read migrates again. `mx.load` instead reads a tensor into a host buffer and copies
it to device memory (`Load::eval_gpu`), and it takes any file-like object. So a set of raw
tensors is presented to it as a safetensors stream: a header naming each as a U8
(rows, row_bytes) tensor, then their bytes, served from the GGUF file at their offsets
(`os.preadv`). MLX reads a stream it is given as a Python object when mx.load is called. On the
CPU and Metal backends it is one copy from the file, as `mx.array` was; on CUDA the bytes pass
through a host buffer MLX allocates per tensor, so there the tensors are read in row ranges
(`piece_bytes`, the ops backend's `raw_piece_bytes`) and put together on the device. On CUDA the
weights take `upload_raw` instead by default (KernelConfig.weights_staged: all of them in one pass
through kernels/upload.py's page-locked staging, GpuOps.begin_weights); mx.load stays the way
for the other backends and with weights_staged = 0.
"""

from __future__ import annotations

import bisect
import io
import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from gguf import GGML_QUANT_SIZES

from .artifact import F16_SCALES, NONFINITE_MASK, RawTensor
from .errors import ArtifactError


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


def _pieces(r: RawTensor, piece_bytes: int | None) -> list[RawTensor]:
    """`r` as row ranges of at most piece_bytes each (at least one row), or whole (None)."""
    row_bytes = r.data.shape[1]
    rows = r.data.shape[0] if piece_bytes is None else max(1, piece_bytes // row_bytes)
    return [RawTensor(r.name, r.qtype, r.shape, r.data[i:i + rows], r.path, r.offset + i * row_bytes)
            for i in range(0, r.data.shape[0], rows)]


def load_raw(raws: list[RawTensor], piece_bytes: int | None = None) -> list[mx.array]:
    """Each raw tensor's (rows, row_bytes) uint8 bytes as an MLX array. Tensors mapped from a file go
    through mx.load of a TensorStream over it; others are copied. piece_bytes: read each tensor in
    row ranges of at most this many bytes, put together on the device (CUDA: MLX stages a load
    in a host buffer it allocates, and glibc maps a buffer over 32 MiB fresh each time; the H200's
    host read 16 MiB pieces at 3.2-3.6 GB/s against 1.1-1.2 GB/s whole, docs/ledger.md 2026-12-02)."""
    out: list[mx.array | None] = [None] * len(raws)
    by_file: dict[Path, list[tuple[int, RawTensor]]] = {}
    for i, r in enumerate(raws):
        if r.path is not None and r.offset is not None:
            by_file.setdefault(r.path, []).extend((i, piece) for piece in _pieces(r, piece_bytes))
        else:
            out[i] = mx.array(np.ascontiguousarray(r.data))
    for path, pieces in by_file.items():
        stream = TensorStream(path, [piece for _, piece in pieces])
        try:
            loaded = mx.load(stream, format="safetensors")
        except (RuntimeError, ValueError, OSError) as exc:   # the file cut or changed since it was opened
            raise ArtifactError(path, f"cannot read its tensors any more (changed since it was opened?): "
                                f"{' '.join(str(exc).split())[:200]}") from None
        finally:
            stream.close()
        parts: dict[int, list[mx.array]] = {}
        for j, (i, _) in enumerate(pieces):
            parts.setdefault(i, []).append(loaded[str(j)])
        for i, arrays in parts.items():
            out[i] = arrays[0] if len(arrays) == 1 else mx.concatenate(arrays)
    return out


def upload_raw(raws: list[RawTensor], upload, piece_bytes: int | None = None) -> list[mx.array]:
    """load_raw through `upload` (a kernels.upload.PinnedUpload: the page-locked staging, CUDA), in one
    pass: each tensor in row ranges of at most piece_bytes (and the staging's half), the pieces
    evaluated on the device, each tensor's put together lazily."""
    from .kernels.upload import Piece

    out: list[mx.array | None] = [None] * len(raws)
    pieces, owners = [], []
    for i, r in enumerate(raws):
        if r.path is None or r.offset is None:
            out[i] = mx.array(np.ascontiguousarray(r.data))
            continue
        for part in _pieces(r, min(piece_bytes or upload.half_bytes, upload.half_bytes)):
            pieces.append(Piece(Path(part.path), part.offset, part.data.nbytes))
            owners.append((i, part.data.shape))
    try:
        loaded = upload.upload(pieces)
    except OSError as exc:   # the file cut since it was opened
        raise ArtifactError(raws[0].path, f"cannot read its tensors any more (changed since it was opened?): "
                            f"{' '.join(str(exc).split())[:200]}") from None
    parts: dict[int, list[mx.array]] = {}
    for (i, shape), a in zip(owners, loaded):
        parts.setdefault(i, []).append(a.reshape(shape))
    for i, arrays in parts.items():
        out[i] = arrays[0] if len(arrays) == 1 else mx.concatenate(arrays)
    return out


def nonfinite_flag(raw: RawTensor, array: mx.array) -> mx.array | None:
    """Whether a matrix's raw bytes, loaded as `array` (rows, row_bytes) uint8, hold what the
    artifact's weight scan refuses (artifact.check_matrix_weights: a NaN/Inf element, |w| >= 65,536
    in F32/BF16, a NaN/Inf f16 block scale), computed by MLX where the bytes are (on a GPU, at its
    bandwidth, instead of a host pass over the file): a bool scalar, lazy; None for a type with
    nothing to check (NVFP4)."""
    if raw.qtype in NONFINITE_MASK:
        dtype, mask, refused = NONFINITE_MASK[raw.qtype]
        bits = array.view(mx.uint32 if dtype == np.uint32 else mx.uint16)
        return mx.any((bits & mask) >= refused)
    if raw.qtype in F16_SCALES:
        offset, count = F16_SCALES[raw.qtype]
        type_size = GGML_QUANT_SIZES[raw.qtype][1]
        b = array.reshape(array.shape[0], -1, type_size)[:, :, offset:offset + 2 * count].astype(mx.uint16)
        bits = b[..., 0::2] | (b[..., 1::2] << 8)
        return mx.any((bits & 0x7C00) == 0x7C00)
    return None
