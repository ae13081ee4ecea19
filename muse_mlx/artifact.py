"""Open a muse-glimmer GGUF and enforce its contract, failing closed.

`open_artifact(path)` memory-maps the file and returns an
`Artifact`: the `Geometry` derived from its metadata, its tensors as raw block
views (nothing is copied or dequantized here), and its tokenizer metadata.
Any departure from the contract raises one `ArtifactError` whose message names
the file, the field or tensor, what was expected and what was found.

Key types and defaults follow the pinned llama.cpp's loader (`llama-model.cpp`,
`models/muse-glimmer.cpp`): integer keys are UINT32, float keys FLOAT32, and a
key that llama.cpp treats as optional gets llama.cpp's default.

The file is untrusted input (issue 19). In order:
1. `scan_header`: a bounded pre-scan of the header and tensor table (every count,
   length and type against the bytes left and sane limits; tensors laid out as
   llama.cpp requires, so offsets are aligned, in the file, non-overlapping and of the
   right length), recording where each key's value lies; the token list against the
   embedding's rows.
2. The keys are read from the mapping at those places, with their types and ranges
   (geometry.py says why each range), strings decoded strictly. (gguf-py's GGUFReader
   read them until 2026-12-02: it builds a numpy view of every array element, ~10 s for a
   202,048-token vocabulary; the tests hold this reading to gguf-py's.)
3. Tensors: names, shapes and types against the contract; norm weights finite and
   |w| <= 1e4 (attn_k_norm: 65,504 / sqrt(head_dim), so f16 K cannot overflow).
4. The weight scan (`check_weights=True`, the default): every F32/F16/BF16 matrix
   element finite and (F32/BF16) below 65,536, every f16 block scale of Q8_0 / Q4_K /
   Q5_K / Q6_K finite; vectorized, a tensor (at most 64 MiB of it) at a time, holes of
   sparse files skipped. Its cost is that of reading the tensor bytes once. Measured on
   2 CPU cores: the test fixtures (4-27 MB) 2-16 ms; a 0.71 GB Q4_K_M file 0.16 s with
   the file in the page cache (4.5 GB/s) and 0.51 s from disk, where reading the file
   alone took 0.60 s; a sparse 16.9 GB full-geometry header file 0.12 s. On the real
   16.9 GB file expect the time of one pass over it (a few seconds from the page
   cache), to be measured on the GPU machine; `check_weights=False` skips it.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from .errors import ArtifactError
from .geometry import (ARCH, KV_ELEMENT_BYTES, LOGIT_SCALE_RANGE, NORM_TENSORS, RMS_EPS_RANGE, ROPE_BASE_MIN,
                       SOFTCAP_RANGE, Geometry, max_context, norm_weight_limit, swa_pattern_from_period)

# Tensor types the engine reads (DESIGN.md §2).
MATRIX_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.NVFP4)
VECTOR_TYPES = (QT.F32, QT.F16, QT.BF16)

_U32, _F32, _STR, _BOOL, _ARR = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING,
                                 GGUFValueType.BOOL, GGUFValueType.ARRAY)


@dataclass(frozen=True)
class RawTensor:
    """One tensor as stored: its type, GGUF shape (`ne`, row length first) and raw bytes.

    `data` is a read-only (rows, row_bytes) uint8 view into the memory-mapped file `path`, whose
    bytes start at `offset` there (weight_stream.load_raw reads them from the file itself); a
    tensor made in memory has neither.
    """

    name: str
    qtype: QT
    shape: tuple[int, ...]
    data: np.ndarray
    path: Path | None = None
    offset: int | None = None

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def row_length(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True)
class Vocabulary:
    """Tokenizer metadata as the GGUF carries it (built into a tokenizer in tokenizer.py)."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int] | None
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    add_bos: bool
    chat_template: str | None
    chat_template_error: str | None = None  # why the file's template could not be read (e.g. invalid UTF-8)
    fim_ids: dict = field(default_factory=dict)   # role (pre, suf, mid, pad, rep, sep) -> id, as the file gives them
    suppress_ids: tuple = ()   # tokenizer.ggml.suppress_tokens: never sampled (llama.cpp's common sampler)


class Artifact:
    """A validated muse-glimmer GGUF: geometry, raw tensors and vocabulary."""

    def __init__(self, path: Path, keys: "_Keys", geometry: Geometry, tensors: dict[str, RawTensor]):
        self.path = path
        self.keys = keys
        self.geometry = geometry
        self.tensors = tensors

    def __getitem__(self, name: str) -> RawTensor:
        return self.tensors[name]

    def release(self, tensors) -> None:
        """Drop the pages of these tensors' bytes from this process's mapping of the file (madvise
        DONTNEED): called once their bytes are copied out (Model) or checked (the weight scan),
        so the process does not hold the file's pages and the copies at once (the pages stay in
        the page cache; a later read maps them again)."""
        release_mapped(self.keys.file, [t.data for t in tensors])

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size

    def tensor_types(self) -> dict[str, str]:
        return {name: t.qtype.name for name, t in self.tensors.items()}

    @cached_property
    def vocabulary(self) -> Vocabulary:
        return _read_vocabulary(self.keys)


def open_artifact(path: str | os.PathLike, *, check_weights: bool = True) -> Artifact:
    """Open and validate `path`; raise `ArtifactError` on any breach of the contract.

    `check_weights=False` skips the scan of matrix weights for NaN/Inf (see the module
    docstring for what it costs); everything else is always checked.
    """
    path = Path(path)
    if not path.exists():
        raise ArtifactError(path, "no such file")
    if not path.is_file():
        raise ArtifactError(path, "not a regular file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ArtifactError(path, f"cannot read: {exc.strerror}") from None
    if magic != b"GGUF":
        raise ArtifactError(path, "not a GGUF file", "magic b'GGUF'", repr(magic))
    try:
        scan = scan_header(path)
    except OSError as exc:
        raise ArtifactError(path, f"cannot read: {exc.strerror or exc}") from None
    _check_vocab_rows(path, scan)
    try:
        file = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ArtifactError(path, f"cannot map: {exc}") from None

    keys = _Keys(path, file, scan)
    arch = keys.string("general.architecture")
    if arch != ARCH:
        raise ArtifactError(path, "general.architecture", repr(ARCH), repr(arch))
    geometry = _read_geometry(keys)
    tensors = _read_tensors(path, file, geometry, scan)
    _check_vectors(path, tensors, geometry)
    if check_weights:
        check_matrix_weights(path, tensors, {t.name: scan.data_start + t.offset for t in scan.tensors},
                             lambda t: release_mapped(file, [t.data]))
    return Artifact(path, keys, geometry, tensors)


def release_mapped(file: np.memmap, views) -> None:
    """madvise(DONTNEED) over the whole pages inside each numpy view of the file's mapping."""
    mm = getattr(file, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    base, page = file.ctypes.data, mmap.PAGESIZE
    for v in views:
        start = v.ctypes.data - base
        first, last = -(-start // page) * page, (start + v.nbytes) // page * page
        if last > first:
            mm.madvise(mmap.MADV_DONTNEED, first, last - first)


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _check_vocab_rows(path: Path, scan: HeaderScan) -> None:
    """The token list and the embedding's rows must agree, checked before gguf-py walks the list."""
    tokens = scan.kv.get("tokenizer.ggml.tokens")
    embd = next((t for t in scan.tensors if t.name == "token_embd.weight"), None)
    if tokens is None or embd is None or tokens[0] != GGUFValueType.ARRAY or len(embd.ne) != 2:
        return  # missing or mistyped: reported with its name by the contract checks below
    if tokens[2] != embd.ne[1]:
        raise ArtifactError(path, "tensor 'token_embd.weight' shape (one row per entry of tokenizer.ggml.tokens)",
                            f"{[embd.ne[0], tokens[2]]}", f"{list(embd.ne)}")


# ---- the bounded header walk -------------------------------------------------------------
#
# A reader that trusts the counts it reads (gguf-py's GGUFReader does) loops for minutes on an
# array of 2^32-1 BOOLs or an array whose element type is ARRAY, and a tensor offset of 2^64-1
# wraps to a view from before the data section. So the header is walked with every count,
# length and size checked against the bytes that are left and against the limits below. The
# walk reads lengths, types and counts (and general.alignment, which places the data), skips
# over values and records where each starts; _Keys reads a value there only when it is asked
# for, every step of it known to stay inside the file.
# Then the tensor table: llama.cpp's own rule (ggml/src/gguf.cpp, gguf_init_from_file_impl)
# is that tensor i starts where tensor i-1's bytes, padded to the alignment, end; that one
# rule makes every offset aligned, inside the data section, non-overlapping, and every
# tensor's byte length equal to its type's size for its shape (a type swapped for another
# valid type moves the next offset). We also refuse bytes after the last tensor's padding,
# so the last tensor's length is pinned too.

GGUF_VERSIONS = (2, 3)  # what gguf-py reads (READER_SUPPORTED_VERSIONS) and llama.cpp writes
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
MAX_KV = 1 << 16  # key/value pairs (a muse-glimmer file has about 35)
MAX_TENSORS = 1 << 16  # tensors (the pinned model has 731)
MAX_KEY_BYTES = 65_535  # the GGUF spec's limit on a key
MAX_TENSOR_NAME_BYTES = 63  # GGML_MAX_NAME - 1
MAX_STRING_BYTES = 1 << 24  # one string value: 16 MiB (chat templates are kilobytes)
MAX_ARRAY = 1 << 24  # elements of any array
# Vocabulary-sized arrays: 2^20 = 1,048,576 entries, 5x the pinned 202,048 and 4x the
# largest vocabulary released to date (262,144). Checked before the walk, so a 2,000,000-token
# file is refused at once rather than after gguf-py has built 2,000,000 string views.
MAX_VOCAB = 1 << 20
VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
              "tokenizer.ggml.merges")
GGML_MAX_DIMS = 4

_SCALAR_BYTES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2,
                 GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4,
                 GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1, GGUFValueType.UINT64: 8,
                 GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}


@dataclass(frozen=True)
class ScannedTensor:
    """One entry of the tensor table as the pre-scan read it (offset relative to the data section)."""

    name: str
    ne: tuple[int, ...]
    qtype: QT
    offset: int
    nbytes: int


@dataclass(frozen=True)
class HeaderScan:
    """What the pre-scan learned: the layout gguf-py will then parse."""

    version: int
    kv: dict[str, tuple[GGUFValueType, GGUFValueType | None, int, int]]  # key -> (type, element type, count,
    #                                                                      where its value's bytes start)
    tensors: list[ScannedTensor]
    alignment: int
    data_start: int
    file_size: int


def _ceil_to(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class _Cursor:
    """Bounded little-endian reads from a memory map; every read names what it was reading."""

    def __init__(self, path: Path, buf, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise ArtifactError(self.path, f"truncated GGUF header: {what} at byte {self.pos} needs {n} bytes",
                                found=f"{max(self.size - self.pos, 0)} left in a file of {self.size}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32_LE.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64_LE.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def skip_strings(self, count: int, what: str) -> None:
        """Step over `count` length-prefixed strings (the hot loop of a 200,000-token vocabulary)."""
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64_LE.unpack_from
        for j in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what} element {j} length")
            (n,) = unpack(buf, pos)
            if n > MAX_STRING_BYTES:
                raise ArtifactError(self.path, f"{what} element {j} at byte {pos} is {n:,} bytes long",
                                    f"at most {MAX_STRING_BYTES:,}")
            pos += 8 + n
        if pos > size:
            self.pos = pos - n
            self.need(n, f"{what} element {count - 1}")
        self.pos = pos

    def string(self, what: str, limit: int, decode: bool) -> str | None:
        n = self.u64(f"{what} length")
        if n > limit:
            raise ArtifactError(self.path, f"{what} at byte {self.pos - 8} is {n:,} bytes long",
                                f"at most {limit:,}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n]) if decode else None
        self.pos += n
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ArtifactError(self.path, f"{what} at byte {self.pos - n}", "valid UTF-8",
                                f"invalid byte {raw[exc.start]:#04x} at position {exc.start}") from None


_U32_LE, _U64_LE = struct.Struct("<I"), struct.Struct("<Q")


def _value_type(path: Path, raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ArtifactError(path, f"{what}", "a GGUF value type 0..12", str(raw)) from None


def scan_header(path: Path) -> HeaderScan:
    """Walk the GGUF header with bounds; raise `ArtifactError` before anything could loop or wrap."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ArtifactError(path, "truncated GGUF header", "at least 24 bytes", f"{size}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _scan(path, buf, size)


def _scan(path: Path, buf, size: int) -> HeaderScan:
    c = _Cursor(path, buf, size)
    if bytes(buf[0:4]) != b"GGUF":
        raise ArtifactError(path, "not a GGUF file", "magic b'GGUF'", repr(bytes(buf[0:4])))
    c.pos = 4
    version = c.u32("version")
    if version & 0xFFFF == 0 and version:
        raise ArtifactError(path, "GGUF byte order", "a little-endian file", "a big-endian one")
    if version not in GGUF_VERSIONS:
        raise ArtifactError(path, "GGUF version", " or ".join(map(str, GGUF_VERSIONS)), str(version))
    n_tensors = c.u64("tensor count")
    n_kv = c.u64("key/value count")
    # Every key/value pair takes at least 13 bytes (key length, type, one byte of value)
    # and every tensor-table entry at least 32 (name length, n_dims, one dim, type, offset).
    for what, n, limit, least in (("key/value count", n_kv, MAX_KV, 13),
                                  ("tensor count", n_tensors, MAX_TENSORS, 32)):
        if n > limit:
            raise ArtifactError(path, what, f"at most {limit:,}", f"{n:,}")
    if n_kv * 13 + n_tensors * 32 > size - c.pos:
        raise ArtifactError(path, f"truncated GGUF header: {n_kv:,} keys and {n_tensors:,} tensors "
                            f"cannot fit in the {size - c.pos:,} bytes left")

    kv: dict[str, tuple[GGUFValueType, GGUFValueType | None, int, int]] = {}
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = c.string(f"key {i}", MAX_KEY_BYTES, decode=True)
        if key in kv:
            raise ArtifactError(path, f"duplicate key {key!r}")
        vtype = _value_type(path, c.u32(f"key {key!r} type"), f"key {key!r} type")
        sub, count, at = None, 1, c.pos
        if vtype == GGUFValueType.STRING:
            c.string(f"key {key!r} value", MAX_STRING_BYTES, decode=False)
        elif vtype == GGUFValueType.ARRAY:
            sub = _value_type(path, c.u32(f"key {key!r} element type"), f"key {key!r} element type")
            if sub == GGUFValueType.ARRAY:
                raise ArtifactError(path, f"key {key!r}", "an array of scalars or strings", "an array of arrays")
            count = c.u64(f"key {key!r} element count")
            at = c.pos
            limit = MAX_VOCAB if key in VOCAB_KEYS else MAX_ARRAY
            if count > limit:
                raise ArtifactError(path, f"key {key!r}", f"at most {limit:,} elements", f"{count:,}")
            if sub == GGUFValueType.STRING:
                c.need(count * 8, f"key {key!r}: {count:,} strings")
                c.skip_strings(count, f"key {key!r}")
            else:
                c.need(count * _SCALAR_BYTES[sub], f"key {key!r}: {count:,} {sub.name} elements")
                c.pos += count * _SCALAR_BYTES[sub]
        else:
            if key == "general.alignment" and vtype == GGUFValueType.UINT32:
                alignment = c.u32("general.alignment")
                if alignment == 0 or alignment & (alignment - 1):
                    raise ArtifactError(path, "key 'general.alignment'", "a power of two", str(alignment))
            else:
                c.need(_SCALAR_BYTES[vtype], f"key {key!r} value")
                c.pos += _SCALAR_BYTES[vtype]
        if key == "general.alignment" and vtype != GGUFValueType.UINT32:
            raise ArtifactError(path, "key 'general.alignment'", "type UINT32", f"type {vtype.name}")
        kv[key] = (vtype, sub, count, at)

    table = []
    for i in range(n_tensors):
        name = c.string(f"tensor {i} name", MAX_TENSOR_NAME_BYTES, decode=True)
        n_dims = c.u32(f"tensor {name!r} dimension count")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise ArtifactError(path, f"tensor {name!r} dimension count", f"1..{GGML_MAX_DIMS}", str(n_dims))
        ne = tuple(c.u64(f"tensor {name!r} dimension {j}") for j in range(n_dims))
        raw_type = c.u32(f"tensor {name!r} type")
        offset = c.u64(f"tensor {name!r} offset")
        table.append((name, ne, raw_type, offset))

    data_start = _ceil_to(c.pos, alignment)
    if data_start > size:
        raise ArtifactError(path, "truncated GGUF: the data section would start at byte "
                            f"{data_start:,}", found=f"a file of {size:,} bytes")
    names: set[str] = set()
    tensors = []
    expected_offset = 0
    for name, ne, raw_type, offset in table:
        if name in names:
            raise ArtifactError(path, f"duplicate tensor {name!r}")
        names.add(name)
        try:
            qtype = QT(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ArtifactError(path, f"tensor {name!r} type", "a known ggml type", str(raw_type)) from None
        if any(d == 0 for d in ne):
            raise ArtifactError(path, f"tensor {name!r} shape", "no zero dimension", str(list(ne)))
        n_elements = 1
        for d in ne:
            n_elements *= d
        if n_elements >= 1 << 62:  # llama.cpp refuses >= INT64_MAX; nothing real comes near 2^62
            raise ArtifactError(path, f"tensor {name!r} shape", "fewer than 2^62 elements", str(list(ne)))
        if ne[0] % block:
            raise ArtifactError(path, f"tensor {name!r} row length",
                                f"a multiple of the {qtype.name} block size {block}", str(ne[0]))
        nbytes = n_elements // block * type_size
        if offset != expected_offset:
            raise ArtifactError(path, f"tensor {name!r} data offset",
                                f"{expected_offset:,} (where the previous tensor's {'padded ' if tensors else ''}"
                                f"bytes end)" if tensors else "0 (the first tensor starts the data section)",
                                f"{offset:,}")
        if data_start + offset + nbytes > size:
            raise ArtifactError(path, f"tensor {name!r} data (truncated file)",
                                f"bytes up to offset {data_start + offset + nbytes:,}", f"a file of {size:,} bytes")
        expected_offset = offset + _ceil_to(nbytes, alignment)
        tensors.append(ScannedTensor(name, ne, qtype, offset, nbytes))
    if tensors and size > data_start + expected_offset:
        raise ArtifactError(path, f"{size - data_start - expected_offset:,} bytes after the last tensor",
                            f"a file of {data_start + expected_offset:,} bytes", f"{size:,}")
    return HeaderScan(version, kv, tensors, alignment, data_start, size)


# ---- metadata ------------------------------------------------------------------------


_NUMPY_SCALARS = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
                  GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
                  GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1", GGUFValueType.UINT64: "<u8",
                  GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}


@dataclass(frozen=True)
class _Field:
    """One key's value, read from the mapped file where the pre-scan found it (every length in it
    already bounded by the scan). types: [type] or [ARRAY, element type]; count: its elements."""

    file: np.ndarray
    types: list[GGUFValueType]
    count: int
    at: int

    def _scalars(self, vtype: GGUFValueType, n: int) -> np.ndarray:
        values = np.frombuffer(self.file, _NUMPY_SCALARS[vtype], n, self.at)
        return values.astype(bool) if vtype == _BOOL else values

    @property
    def raw(self) -> bytes:
        """A STRING's bytes."""
        n = int(np.frombuffer(self.file, "<u8", 1, self.at)[0])
        return self.file[self.at + 8:self.at + 8 + n].tobytes()

    def strings(self) -> list[bytes]:
        """An ARRAY of STRING's elements' bytes."""
        out, pos, unpack, buf = [], 0, _U64_LE.unpack_from, memoryview(self.file)[self.at:]
        for _ in range(self.count):
            (n,) = unpack(buf, pos)
            out.append(bytes(buf[pos + 8:pos + 8 + n]))
            pos += 8 + n
        return out

    def contents(self):
        """The value as Python: a number or bool, a str, or a list of them."""
        if self.types[0] == _ARR:
            if self.types[1] == _STR:
                return [b.decode("utf-8", errors="replace") for b in self.strings()]
            return self._scalars(self.types[1], self.count).tolist()
        if self.types[0] == _STR:
            return self.raw.decode("utf-8", errors="replace")
        return self._scalars(self.types[0], 1)[0].item()


class _Keys:
    """Typed access to GGUF metadata, read from the mapped file at the places the bounded pre-scan
    found (gguf-py's reader builds numpy views of every element of every array, ~10 s for a
    202,048-token vocabulary; tests/test_artifact.py holds this reading to gguf-py's on every
    key of every fixture). Every failure names the key."""

    def __init__(self, path: Path, file: np.ndarray, scan: HeaderScan):
        self.path, self.file, self.scan = path, file, scan

    def field(self, key: str, required: bool) -> _Field | None:
        entry = self.scan.kv.get(key)
        if entry is None:
            if required:
                raise ArtifactError(self.path, f"missing required key {key!r}")
            return None
        vtype, sub, count, at = entry
        return _Field(self.file, [vtype] if sub is None else [vtype, sub], count, at)

    def _type_name(self, f) -> str:
        return "/".join(t.name for t in f.types) if f.types else "?"

    def scalar(self, key: str, vtype: GGUFValueType, required: bool = True, default=None):
        f = self.field(key, required)
        if f is None:
            return default
        if f.types != [vtype]:
            raise ArtifactError(self.path, f"key {key!r}", f"type {vtype.name}", f"type {self._type_name(f)}")
        return f.contents()

    def string(self, key: str, required: bool = True):
        """A STRING key, decoded strictly: invalid UTF-8 is refused with the key's name."""
        f = self.field(key, required)
        if f is None:
            return None
        if f.types != [_STR]:
            raise ArtifactError(self.path, f"key {key!r}", f"type {_STR.name}", f"type {self._type_name(f)}")
        return decode_utf8(self.path, f.raw, f"key {key!r}")

    def u32(self, key: str, required: bool = True, default=None):
        return self.scalar(key, _U32, required, default)

    def f32(self, key: str, required: bool = True, default=None, lo=None, hi=None, zero_ok=False):
        """A FLOAT32 key: finite, and (if given) in [lo, hi] (0 also allowed when `zero_ok`)."""
        value = self.scalar(key, _F32, required, default)
        if value is None:
            return None
        value = float(value)
        if not np.isfinite(value):
            raise ArtifactError(self.path, f"key {key!r}", "a finite float", repr(value))
        if (lo is not None or hi is not None) and not (zero_ok and value == 0.0):
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                want = f"a value in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else \
                    (f"a value >= {lo:g}" if lo is not None else f"a value <= {hi:g}")
                raise ArtifactError(self.path, f"key {key!r}", want + (" (or 0)" if zero_ok else ""), repr(value))
        return value

    def u32_or_uniform_array(self, key: str, n_layer: int, required: bool = True, default=None):
        """llama.cpp's get_key_or_arr: a UINT32, or a per-layer UINT32 array (which must be uniform here)."""
        f = self.field(key, required)
        if f is None:
            return default
        if f.types == [_U32]:
            return f.contents()
        if f.types == [_ARR, _U32]:
            values = f.contents()
            if len(values) != n_layer:
                raise ArtifactError(self.path, f"key {key!r}", f"{n_layer} per-layer values",
                                    f"{len(values)}")
            if len(set(values)) != 1:
                raise ArtifactError(self.path, f"key {key!r}", "the same value for every layer",
                                    f"{sorted(set(values))}")
            return values[0]
        raise ArtifactError(self.path, f"key {key!r}", "type UINT32 or ARRAY/UINT32",
                            f"type {self._type_name(f)}")


def _read_geometry(keys: _Keys) -> Geometry:
    path = keys.path
    k = lambda name: f"{ARCH}.{name}"  # noqa: E731
    n_layer = keys.u32(k("block_count"))
    if n_layer == 0:
        raise ArtifactError(path, f"key {k('block_count')!r}", "at least 1 layer", "0")
    n_embd = keys.u32(k("embedding_length"))
    n_ff = keys.u32_or_uniform_array(k("feed_forward_length"), n_layer)
    n_head = keys.u32_or_uniform_array(k("attention.head_count"), n_layer)
    n_head_kv = keys.u32_or_uniform_array(k("attention.head_count_kv"), n_layer, required=False,
                                          default=n_head)
    for name, value in ((k("embedding_length"), n_embd), (k("feed_forward_length"), n_ff),
                        (k("attention.head_count"), n_head), (k("attention.head_count_kv"), n_head_kv)):
        if value == 0:
            raise ArtifactError(path, f"key {name!r}", "a positive value", "0")
    if n_head % n_head_kv:
        raise ArtifactError(path, f"key {k('attention.head_count_kv')!r}",
                            f"a divisor of head_count {n_head}", str(n_head_kv))
    head_dim = keys.u32(k("attention.key_length"), required=False, default=n_embd // n_head)
    value_dim = keys.u32(k("attention.value_length"), required=False, default=head_dim)
    if value_dim != head_dim:
        raise ArtifactError(path, f"key {k('attention.value_length')!r}",
                            f"equal to key_length {head_dim}", str(value_dim))
    for swa_key in ("attention.key_length_swa", "attention.value_length_swa"):
        v = keys.u32(k(swa_key), required=False)
        if v is not None and v != head_dim:
            raise ArtifactError(path, f"key {k(swa_key)!r}", f"equal to key_length {head_dim}", str(v))
    rope_dim = keys.u32(k("rope.dimension_count"), required=False, default=head_dim)
    rope_dim_swa = keys.u32(k("rope.dimension_count_swa"), required=False, default=rope_dim)
    if rope_dim_swa != rope_dim:
        raise ArtifactError(path, f"key {k('rope.dimension_count_swa')!r}",
                            f"equal to rope.dimension_count {rope_dim}", str(rope_dim_swa))
    if rope_dim == 0 or rope_dim > head_dim or rope_dim % 2:
        raise ArtifactError(path, f"key {k('rope.dimension_count')!r}",
                            f"an even value in 2..{head_dim}", str(rope_dim))

    window = keys.u32(k("attention.sliding_window"))
    if not 0 < window < 2**31:   # positions and their distances are int32 on the device
        raise ArtifactError(path, f"key {k('attention.sliding_window')!r}", "a window in 1..2,147,483,647",
                            f"{window:,}")
    context = keys.u32(k("context_length"))
    if context == 0:
        raise ArtifactError(path, f"key {k('context_length')!r}", "a positive context length", "0")
    kv_dim = n_head_kv * head_dim
    limit = max_context(kv_dim)
    if context > limit:
        # The bytes a slot's f16 K/V would need at this context (DESIGN.md §3), computed in Python ints.
        swa = _read_swa_pattern(keys, k("attention.sliding_window_pattern"), n_layer)
        n_swa = sum(swa)
        need = (n_swa * min(context, window) + (n_layer - n_swa) * context) * 2 * kv_dim * KV_ELEMENT_BYTES
        raise ArtifactError(path, f"key {k('context_length')!r}",
                            f"at most {limit:,} positions (a slot's f16 K/V at {context:,} positions would "
                            f"need {need:,} bytes)", f"{context:,}")
    eps = keys.f32(k("attention.layer_norm_rms_epsilon"), lo=RMS_EPS_RANGE[0], hi=RMS_EPS_RANGE[1])
    rope_base = keys.f32(k("rope.freq_base"), required=False, default=10_000.0, lo=ROPE_BASE_MIN)
    rope_base_swa = keys.f32(k("rope.freq_base_swa"), required=False, default=rope_base, lo=ROPE_BASE_MIN)
    logit_scale = keys.f32(k("logit_scale"), lo=LOGIT_SCALE_RANGE[0], hi=LOGIT_SCALE_RANGE[1])
    softcap = keys.f32(k("final_logit_softcapping"), required=False, default=0.0,
                       lo=SOFTCAP_RANGE[0], hi=SOFTCAP_RANGE[1], zero_ok=True)

    swa_layers = _read_swa_pattern(keys, k("attention.sliding_window_pattern"), n_layer)

    tokens = keys.field("tokenizer.ggml.tokens", required=True)
    if tokens.types != [_ARR, _STR]:
        raise ArtifactError(path, "key 'tokenizer.ggml.tokens'", "type ARRAY/STRING",
                            f"type {keys._type_name(tokens)}")
    n_vocab = tokens.count
    if n_vocab == 0:
        raise ArtifactError(path, "key 'tokenizer.ggml.tokens'", "a non-empty vocabulary", "0 tokens")

    try:
        return Geometry(
            n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
            n_ff=n_ff, n_vocab=n_vocab, sliding_window=window, context_length=context,
            rms_eps=float(eps), rope_base=float(rope_base), rope_base_swa=float(rope_base_swa),
            logit_scale=float(logit_scale), final_logit_softcap=float(softcap) if softcap else None,
            rope_dim=rope_dim, swa_layers=swa_layers,
        )
    except ValueError as exc:  # a backstop: the key checks above name the key first
        raise ArtifactError(path, str(exc)) from None


def _read_swa_pattern(keys: _Keys, key: str, n_layer: int) -> tuple[bool, ...]:
    """llama.cpp's load_swa_pattern(4): a per-layer BOOL array, else a UINT32 period, else period 4."""
    f = keys.field(key, required=False)
    if f is None:
        return swa_pattern_from_period(n_layer, 4)
    if f.types == [_ARR, _BOOL]:
        pattern = tuple(bool(v) for v in f.contents())
        if len(pattern) != n_layer:
            raise ArtifactError(keys.path, f"key {key!r}", f"{n_layer} per-layer flags", f"{len(pattern)}")
        return pattern
    if f.types == [_U32]:
        return swa_pattern_from_period(n_layer, f.contents())
    raise ArtifactError(keys.path, f"key {key!r}", "type ARRAY/BOOL or UINT32", f"type {keys._type_name(f)}")


# ---- tensors -------------------------------------------------------------------------


def _read_tensors(path: Path, file: np.ndarray, g: Geometry, scan: HeaderScan) -> dict[str, RawTensor]:
    """The contract's tensors as views of the mapped file, where the pre-scan placed them."""
    expected = g.tensor_shapes()
    found = {t.name: t for t in scan.tensors}
    unknown = sorted(set(found) - set(expected))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ArtifactError(path, f"unknown tensor {unknown[0]!r}{more}", "only muse-glimmer tensors")
    tensors = {}
    for name, shape in expected.items():
        t = found.get(name)
        if t is None:
            raise ArtifactError(path, f"missing tensor {name!r}", f"shape {list(shape)}")
        if t.ne != shape:
            raise ArtifactError(path, f"tensor {name!r} shape", f"{list(shape)}", f"{list(t.ne)}")
        allowed = VECTOR_TYPES if len(shape) == 1 else MATRIX_TYPES
        if t.qtype not in allowed:
            raise ArtifactError(path, f"tensor {name!r} type", "one of " + ", ".join(a.name for a in allowed),
                                t.qtype.name)
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        row_bytes = shape[0] // block * type_size
        first = scan.data_start + t.offset
        data = file[first:first + t.nbytes].reshape(t.nbytes // row_bytes, row_bytes)
        tensors[name] = RawTensor(name, t.qtype, shape, data, path, first)
    return tensors


def _as_float32(t: RawTensor) -> np.ndarray:
    """An F32/F16/BF16 tensor's values as float32 (numpy only; BF16 by a 16-bit shift)."""
    if t.qtype == QT.F32:
        return t.data.view(np.float32).reshape(-1)
    if t.qtype == QT.F16:
        return t.data.view(np.float16).reshape(-1).astype(np.float32)
    return (t.data.view(np.uint16).reshape(-1).astype(np.uint32) << 16).view(np.float32)


def _check_vectors(path: Path, tensors: dict[str, RawTensor], g: Geometry) -> None:
    """Norm weights: finite, and small enough not to overflow float32 (f16 for K) activations."""
    for name, t in tensors.items():
        if len(t.shape) == 1 and any(name.endswith(f"{n}.weight") for n in NORM_TENSORS + ("output_norm",)):
            values = _as_float32(t)
            limit = norm_weight_limit(name, g.head_dim)
            with np.errstate(invalid="ignore"):
                bad = ~(np.abs(values) <= limit)  # NaN compares False: caught here too
            if bad.any():
                i = int(np.argmax(bad))
                v = float(values[i])
                if not np.isfinite(v):
                    raise ArtifactError(path, f"tensor {name!r} element {i}", "a finite norm weight", repr(v))
                raise ArtifactError(path, f"tensor {name!r} element {i}",
                                    f"a norm weight with |w| <= {limit:g} (larger overflows activations)", repr(v))


# ---- the weight scan -----------------------------------------------------------------
#
# Where a non-finite value can hide in a matrix: every element of an F32/F16/BF16 tensor,
# and the f16 scales of quantized blocks (a block's values are its scales times small
# integers, so finite scales mean finite values). NVFP4's UE4M3 scales have no inf/NaN
# encoding (ggml maps 0x7F to 0), so NVFP4 blocks are always finite.
# F32 and BF16 elements are also held inside f16's range (|w| < 65,536), which every f16
# conversion of a model satisfies and which keeps the embedding's squares (RMSNorm) and
# every product of a weight with a normed activation far from float32 overflow; a finite
# 3e38 weight overflows on its first multiply. The test is on the exponent bits alone.

# (byte offset, count) of the f16 scales in each block: d (and dmin) of ggml-common.h.
F16_SCALES = {QT.Q8_0: (0, 1), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208, 1)}
# Per float format: (view dtype, exponent mask, smallest refused exponent bits): inf/NaN for
# F16 (its largest finite value is 65,504), |w| >= 2^16 = 65,536 (and inf/NaN) for F32 and BF16.
NONFINITE_MASK = {QT.F32: (np.uint32, 0x7F800000, 0x47800000), QT.F16: (np.uint16, 0x7C00, 0x7C00),
                   QT.BF16: (np.uint16, 0x7F80, 0x4780)}
_SCAN_CHUNK_BYTES = 64 << 20  # bound the temporaries: one 64 MiB slice of a tensor at a time (a thread)
SCAN_THREADS = min(8, os.cpu_count() or 1)


def _is_hole(fd: int, start: int, length: int) -> bool:
    """True when [start, start+length) is a hole of a sparse file (reads as zeros: finite)."""
    seek_data = getattr(os, "SEEK_DATA", None)
    if seek_data is None or length == 0:
        return False
    try:
        return os.lseek(fd, start, seek_data) >= start + length
    except OSError as exc:  # ENXIO: no data at or after start; anything else: the file system cannot say
        return exc.errno == errno.ENXIO


def _first_nonfinite(t: RawTensor) -> tuple[int, int, float] | None:
    """(row, column, value) of the first non-finite element or block scale, or None."""
    rows, row_bytes = t.data.shape
    chunk_rows = max(1, _SCAN_CHUNK_BYTES // max(row_bytes, 1))
    if t.qtype in NONFINITE_MASK:
        dtype, mask, refused = NONFINITE_MASK[t.qtype]
        for r0 in range(0, rows, chunk_rows):
            bits = t.data[r0:r0 + chunk_rows].view(dtype)
            bad = (bits & dtype(mask)) >= dtype(refused)
            if bad.any():
                r, col = np.unravel_index(int(np.argmax(bad)), bad.shape)
                value = _as_float32(RawTensor(t.name, t.qtype, (bits.shape[1],), t.data[r0 + r:r0 + r + 1]))[col]
                return r0 + int(r), int(col), float(value)
        return None
    if t.qtype in F16_SCALES:
        offset, count = F16_SCALES[t.qtype]
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        per_row = row_bytes // type_size
        for r0 in range(0, rows, chunk_rows):
            blocks = t.data[r0:r0 + chunk_rows].reshape(-1, per_row, type_size)
            scales = np.ascontiguousarray(blocks[:, :, offset:offset + 2 * count]).view(np.uint16)
            bad = (scales & np.uint16(0x7C00)) == np.uint16(0x7C00)
            if bad.any():
                r, b, k = np.unravel_index(int(np.argmax(bad)), bad.shape)
                return r0 + int(r), int(b) * block, float(scales[r, b, k:k + 1].view(np.float16)[0])
        return None
    return None  # NVFP4: no non-finite encoding


def check_matrix_weights(path: Path, tensors: dict[str, RawTensor], offsets: dict[str, int], done=None) -> None:
    """Refuse a matrix with a NaN/Inf (or, F32/BF16, |w| >= 65,536) element or a NaN/Inf block scale.

    Vectorized, at most 64 MiB of a tensor at a time, tensors on up to SCAN_THREADS threads (numpy
    releases the GIL; most of the time is the mapping's page faults, which run in parallel); the
    first bad tensor in `tensors`' order is the one named. A tensor lying wholly in a hole of a
    sparse file is skipped (holes read as zeros).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        matrices = [(name, t) for name, t in tensors.items()
                    if len(t.shape) == 2 and not _is_hole(fd, offsets[name], t.nbytes)]
    finally:
        os.close(fd)

    def scan(item):
        found = _first_nonfinite(item[1])
        if done is not None:
            done(item[1])
        return found

    with ThreadPoolExecutor(max_workers=max(1, min(SCAN_THREADS, len(matrices)))) as pool:
        for (name, t), found in zip(matrices, pool.map(scan, matrices)):
            if found is not None:
                row, col, value = found
                if t.qtype in NONFINITE_MASK:
                    raise ArtifactError(path, f"tensor {name!r} row {row} element {col}",
                                        "finite weights of magnitude below 65,536", repr(value))
                raise ArtifactError(path, f"tensor {name!r} row {row} block scale at element {col}",
                                    "a finite scale", repr(value))


# ---- vocabulary ----------------------------------------------------------------------


def _read_vocabulary(keys: _Keys) -> Vocabulary:
    path = keys.path
    model = keys.string("tokenizer.ggml.model")
    pre = keys.string("tokenizer.ggml.pre", required=False)
    tok_field = keys.field("tokenizer.ggml.tokens", required=True)
    tokens = _decode_strings(path, tok_field, "tokenizer.ggml.tokens")
    types_field = keys.field("tokenizer.ggml.token_type", required=False)
    token_types = None
    if types_field is not None:
        if types_field.types != [_ARR, GGUFValueType.INT32]:
            raise ArtifactError(path, "key 'tokenizer.ggml.token_type'", "type ARRAY/INT32",
                                f"type {keys._type_name(types_field)}")
        token_types = types_field.contents()
        if len(token_types) != len(tokens):
            raise ArtifactError(path, "key 'tokenizer.ggml.token_type'", f"{len(tokens)} entries",
                                str(len(token_types)))
    merges_field = keys.field("tokenizer.ggml.merges", required=False)
    merges = []
    if merges_field is not None:
        if merges_field.types != [_ARR, _STR]:
            raise ArtifactError(path, "key 'tokenizer.ggml.merges'", "type ARRAY/STRING",
                                f"type {keys._type_name(merges_field)}")
        merges = _decode_strings(path, merges_field, "tokenizer.ggml.merges")

    def token_id(key):
        v = keys.u32(key, required=False)
        if v is not None and v >= len(tokens):
            raise ArtifactError(path, f"key {key!r}", f"a token id below {len(tokens)}", str(v))
        return v

    suppress_ids = ()   # llama-vocab.cpp: an INT32 array, else the file is refused; ids out of range dropped
    suppress_field = keys.field("tokenizer.ggml.suppress_tokens", required=False)
    if suppress_field is not None:
        if suppress_field.types != [_ARR, GGUFValueType.INT32]:
            raise ArtifactError(path, "key 'tokenizer.ggml.suppress_tokens'", "type ARRAY/INT32",
                                f"type {keys._type_name(suppress_field)}")
        suppress_ids = tuple(sorted({int(t) for t in suppress_field.contents() if 0 <= int(t) < len(tokens)}))
    fim_ids = {}   # llama-vocab.cpp's order: the deprecated names, read after, win
    for role, key in (("pre", "fim_pre"), ("suf", "fim_suf"), ("mid", "fim_mid"), ("pad", "fim_pad"),
                      ("rep", "fim_rep"), ("sep", "fim_sep"), ("pre", "prefix"), ("suf", "suffix"), ("mid", "middle")):
        v = token_id(f"tokenizer.ggml.{key}_token_id")
        if v is not None:
            fim_ids[role] = v
    add_bos_field = keys.field("tokenizer.ggml.add_bos_token", required=False)
    if add_bos_field is not None and add_bos_field.types != [_BOOL]:
        raise ArtifactError(path, "key 'tokenizer.ggml.add_bos_token'", "type BOOL",
                            f"type {keys._type_name(add_bos_field)}")
    add_bos = bool(add_bos_field.contents()) if add_bos_field is not None else False
    # The chat template is only needed for chat: a broken one is reported when it is used
    # (MuseTokenizer.apply_chat_template), so plain prompts still work.
    template, template_error = None, None
    try:
        template = keys.string("tokenizer.chat_template", required=False)
    except ArtifactError as exc:
        template_error = str(exc)
    return Vocabulary(
        model=model, pre=pre, tokens=tokens, token_types=token_types, merges=merges,
        bos_id=token_id("tokenizer.ggml.bos_token_id"), eos_id=token_id("tokenizer.ggml.eos_token_id"),
        eot_id=token_id("tokenizer.ggml.eot_token_id"), eom_id=token_id("tokenizer.ggml.eom_token_id"),
        add_bos=add_bos, chat_template=template, chat_template_error=template_error, fim_ids=fim_ids,
        suppress_ids=suppress_ids,
    )


def decode_utf8(path: Path, raw: bytes, what: str) -> str:
    """Strict UTF-8; an invalid byte is refused with `what` and its position."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArtifactError(path, what, "valid UTF-8",
                            f"invalid byte {raw[exc.start]:#04x} at byte {exc.start}") from None


def _decode_strings(path: Path, field: _Field, key: str) -> list[str]:
    """An ARRAY/STRING field's elements, strictly decoded; an invalid one is named by its index."""
    out = []
    for n, raw in enumerate(field.strings()):
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(decode_utf8(path, raw, f"key {key!r} element {n}"))
    return out