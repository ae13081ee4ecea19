"""Open a muse-glimmer GGUF and enforce its contract, failing closed.

`open_artifact(path)` memory-maps the file with gguf-py's reader and returns an
`Artifact`: the `Geometry` derived from its metadata, its tensors as raw block
views (nothing is copied or dequantized here), and its tokenizer metadata.
Any departure from the contract raises one `ArtifactError` whose message names
the file, the field or tensor, what was expected and what was found.

Key types and defaults follow the pinned llama.cpp's loader (`llama-model.cpp`,
`models/muse-glimmer.cpp`): integer keys are UINT32, float keys FLOAT32, and a
key that llama.cpp treats as optional gets llama.cpp's default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from .errors import ArtifactError
from .geometry import ARCH, NORM_TENSORS, Geometry, swa_pattern_from_period

# Tensor types the engine reads (DESIGN.md §2).
MATRIX_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.NVFP4)
VECTOR_TYPES = (QT.F32, QT.F16, QT.BF16)

_U32, _F32, _STR, _BOOL, _ARR = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING,
                                 GGUFValueType.BOOL, GGUFValueType.ARRAY)


@dataclass(frozen=True)
class RawTensor:
    """One tensor as stored: its type, GGUF shape (`ne`, row length first) and raw bytes.

    `data` is a read-only (rows, row_bytes) uint8 view into the memory-mapped file.
    """

    name: str
    qtype: QT
    shape: tuple[int, ...]
    data: np.ndarray

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


class Artifact:
    """A validated muse-glimmer GGUF: geometry, raw tensors and vocabulary."""

    def __init__(self, path: Path, reader: GGUFReader, geometry: Geometry,
                 tensors: dict[str, RawTensor]):
        self.path = path
        self.reader = reader
        self.geometry = geometry
        self.tensors = tensors

    def __getitem__(self, name: str) -> RawTensor:
        return self.tensors[name]

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size

    def tensor_types(self) -> dict[str, str]:
        return {name: t.qtype.name for name, t in self.tensors.items()}

    @cached_property
    def vocabulary(self) -> Vocabulary:
        return _read_vocabulary(self.path, self.reader)


def open_artifact(path: str | os.PathLike) -> Artifact:
    """Open and validate `path`; raise `ArtifactError` on any breach of the contract."""
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
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf-py raises ValueError/IndexError/... on damaged files
        raise ArtifactError(path, f"unreadable GGUF (truncated or corrupt): {exc}") from None

    keys = _Keys(path, reader)
    arch = keys.string("general.architecture")
    if arch != ARCH:
        raise ArtifactError(path, "general.architecture", repr(ARCH), repr(arch))
    geometry = _read_geometry(keys)
    tensors = _read_tensors(path, reader, geometry)
    _check_vectors_finite(path, tensors)
    return Artifact(path, reader, geometry, tensors)


# ---- metadata ------------------------------------------------------------------------


class _Keys:
    """Typed access to GGUF metadata; every failure names the key."""

    def __init__(self, path: Path, reader: GGUFReader):
        self.path, self.reader = path, reader

    def field(self, key: str, required: bool):
        f = self.reader.get_field(key)
        if f is None and required:
            raise ArtifactError(self.path, f"missing required key {key!r}")
        return f

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
        return self.scalar(key, _STR, required)

    def u32(self, key: str, required: bool = True, default=None):
        return self.scalar(key, _U32, required, default)

    def f32(self, key: str, required: bool = True, default=None):
        value = self.scalar(key, _F32, required, default)
        if value is not None and not np.isfinite(value):
            raise ArtifactError(self.path, f"key {key!r}", "a finite float", repr(value))
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
    if window == 0:
        raise ArtifactError(path, f"key {k('attention.sliding_window')!r}", "a positive window", "0")
    context = keys.u32(k("context_length"))
    if context == 0:
        raise ArtifactError(path, f"key {k('context_length')!r}", "a positive context length", "0")
    eps = keys.f32(k("attention.layer_norm_rms_epsilon"))
    if not eps > 0:
        raise ArtifactError(path, f"key {k('attention.layer_norm_rms_epsilon')!r}", "a positive epsilon",
                            repr(eps))
    rope_base = keys.f32(k("rope.freq_base"), required=False, default=10_000.0)
    rope_base_swa = keys.f32(k("rope.freq_base_swa"), required=False, default=rope_base)
    if not rope_base_swa > 0:
        raise ArtifactError(path, f"key {k('rope.freq_base_swa')!r}", "a positive base", repr(rope_base_swa))
    logit_scale = keys.f32(k("logit_scale"))
    softcap = keys.f32(k("final_logit_softcapping"), required=False, default=0.0)
    if softcap < 0:
        raise ArtifactError(path, f"key {k('final_logit_softcapping')!r}", "a value >= 0", repr(softcap))

    swa_layers = _read_swa_pattern(keys, k("attention.sliding_window_pattern"), n_layer)

    tokens = keys.field("tokenizer.ggml.tokens", required=True)
    if tokens.types != [_ARR, _STR]:
        raise ArtifactError(path, "key 'tokenizer.ggml.tokens'", "type ARRAY/STRING",
                            f"type {keys._type_name(tokens)}")
    n_vocab = len(tokens.data)
    if n_vocab == 0:
        raise ArtifactError(path, "key 'tokenizer.ggml.tokens'", "a non-empty vocabulary", "0 tokens")

    return Geometry(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_ff=n_ff, n_vocab=n_vocab, sliding_window=window, context_length=context,
        rms_eps=float(eps), rope_base=float(rope_base), rope_base_swa=float(rope_base_swa),
        logit_scale=float(logit_scale), final_logit_softcap=float(softcap) if softcap else None,
        rope_dim=rope_dim, swa_layers=swa_layers,
    )


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


def _read_tensors(path: Path, reader: GGUFReader, g: Geometry) -> dict[str, RawTensor]:
    expected = g.tensor_shapes()
    found = {t.name: t for t in reader.tensors}
    unknown = sorted(set(found) - set(expected))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ArtifactError(path, f"unknown tensor {unknown[0]!r}{more}", "only muse-glimmer tensors")
    file_size = path.stat().st_size
    tensors = {}
    for name, shape in expected.items():
        t = found.get(name)
        if t is None:
            raise ArtifactError(path, f"missing tensor {name!r}", f"shape {list(shape)}")
        got = tuple(int(x) for x in t.shape)
        if got != shape:
            raise ArtifactError(path, f"tensor {name!r} shape", f"{list(shape)}", f"{list(got)}")
        allowed = VECTOR_TYPES if len(shape) == 1 else MATRIX_TYPES
        if t.tensor_type not in allowed:
            raise ArtifactError(path, f"tensor {name!r} type", "one of " + ", ".join(a.name for a in allowed),
                                t.tensor_type.name)
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        if shape[0] % block:
            raise ArtifactError(path, f"tensor {name!r} row length",
                                f"a multiple of the {t.tensor_type.name} block size {block}", str(shape[0]))
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
        if t.data_offset + nbytes > file_size:
            raise ArtifactError(path, f"tensor {name!r} data (truncated file)",
                                f"bytes up to offset {t.data_offset + nbytes}", f"a file of {file_size} bytes")
        rows = nbytes // (shape[0] // block * type_size)
        data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        tensors[name] = RawTensor(name, t.tensor_type, shape, data)
    return tensors


def _check_vectors_finite(path: Path, tensors: dict[str, RawTensor]) -> None:
    from .quant import dequantize_numpy

    for name, t in tensors.items():
        if len(t.shape) == 1 and any(name.endswith(f"{n}.weight") for n in NORM_TENSORS + ("output_norm",)):
            values = dequantize_numpy(t)
            bad = ~np.isfinite(values)
            if bad.any():
                i = int(np.argmax(bad))
                raise ArtifactError(path, f"tensor {name!r} element {i}", "a finite norm weight",
                                    repr(float(values.reshape(-1)[i])))


# ---- vocabulary ----------------------------------------------------------------------


def _read_vocabulary(path: Path, reader: GGUFReader) -> Vocabulary:
    keys = _Keys(path, reader)
    model = keys.string("tokenizer.ggml.model")
    pre = keys.string("tokenizer.ggml.pre", required=False)
    tok_field = keys.field("tokenizer.ggml.tokens", required=True)
    tokens = [bytes(tok_field.parts[i]).decode("utf-8", errors="replace") for i in tok_field.data]
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
        merges = [bytes(merges_field.parts[i]).decode("utf-8", errors="replace") for i in merges_field.data]

    def token_id(key):
        v = keys.u32(key, required=False)
        if v is not None and v >= len(tokens):
            raise ArtifactError(path, f"key {key!r}", f"a token id below {len(tokens)}", str(v))
        return v

    add_bos_field = keys.field("tokenizer.ggml.add_bos_token", required=False)
    add_bos = bool(add_bos_field.contents()) if add_bos_field is not None else False
    return Vocabulary(
        model=model, pre=pre, tokens=tokens, token_types=token_types, merges=merges,
        bos_id=token_id("tokenizer.ggml.bos_token_id"), eos_id=token_id("tokenizer.ggml.eos_token_id"),
        eot_id=token_id("tokenizer.ggml.eot_token_id"), eom_id=token_id("tokenizer.ggml.eom_token_id"),
        add_bos=add_bos, chat_template=keys.string("tokenizer.chat_template", required=False),
    )
