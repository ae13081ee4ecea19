"""Synthetic muse-glimmer GGUFs (all numbers they produce are synthetic).

- `write_fixture`: a deterministic, well-conditioned model for any geometry and
  seed, with F32 / F16 / BF16 / Q8_0 matrices (quantized by gguf-py), a byte-level
  BPE vocabulary and a chat template. The pinned llama.cpp loads these files.
- `write_random_blocks`: random *valid* blocks in any type mix (e.g. the Q4_K_M
  layout at the full pinned geometry, ~16.9 GB) for kernels and benchmarks.
- `write_sparse`: header and tensor table only, data left as a hole: a
  full-geometry file that costs no disk, for contract checks and accounting.

Every writer goes through `write_gguf`, which writes to a temporary file beside
the target and renames it into place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize

from .fixture_vocab import SPECIAL_TOKENS, FixtureVocab, build_vocab
from ..geometry import ARCH, Geometry
from ..quant import block_bytes, block_size, row_bytes

# The default fixture: small enough for CPU tests, shaped like the pinned model
# (GQA 4:1, two full NoPE layers among six sliding ones) and with a 64-position
# window so short sequences cross the ring wrap. Synthetic numerics: eps is large
# enough that a wrong epsilon shows in the logits.
DEFAULT_GEOMETRY = Geometry(
    n_layer=8,
    n_embd=256,
    n_head=8,
    n_head_kv=2,
    head_dim=32,
    n_ff=768,
    n_vocab=512,
    sliding_window=64,
    context_length=4096,
    rms_eps=1e-3,
    rope_base=1_000_000.0,
    rope_base_swa=10_000.0,
    logit_scale=2.0,
    final_logit_softcap=30.0,
)
DEFAULT_SEED = 0
FIXTURE_FORMAT_VERSION = 1  # bump when the bytes a given (geometry, seed, type) produce change

WRITABLE_WEIGHT_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0)


# ---- tensor type maps ----------------------------------------------------------------


def uniform_types(g: Geometry, matrix_type: QT) -> dict[str, QT]:
    """Every matrix in `matrix_type`, every vector F32."""
    return {name: (matrix_type if len(shape) == 2 else QT.F32) for name, shape in g.tensor_shapes().items()}


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp llama-quant.cpp: the layers that get more bits in the *_K_M mixes."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def kquant_mix(g: Geometry, body: QT = QT.Q4_K) -> dict[str, QT]:
    """The Q4_K_M layout (llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_Q4_K_M): Q4_K body,
    Q6_K `output`, and Q6_K `attn_v` / `ffn_down` in the "more bits" layers."""
    types = uniform_types(g, body)
    types["output.weight"] = QT.Q6_K
    for il in range(g.n_layer):
        if _use_more_bits(il, g.n_layer):
            types[f"blk.{il}.attn_v.weight"] = QT.Q6_K
            types[f"blk.{il}.ffn_down.weight"] = QT.Q6_K
    return types


def gguf_bytes(g: Geometry, types: dict[str, QT]) -> int:
    """Bytes of tensor data (unpadded) for a type map."""
    total = 0
    for name, shape in g.tensor_shapes().items():
        rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        total += rows * row_bytes(types[name], shape[0])
    return total


# ---- values --------------------------------------------------------------------------


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def synthetic_values(g: Geometry, name: str, seed: int) -> np.ndarray:
    """Well-conditioned float32 values for one tensor, (rows, row_length), independent of order.

    Matrices are N(0, 1/fan_in), so every projection keeps unit scale; the
    embedding is N(0, 1) (a weightless RMSNorm follows); norm weights are
    1 + N(0, 0.1^2), so every norm multiplies by something near one.
    """
    shape = g.tensor_shapes()[name]
    rng = _rng(seed, name)
    if len(shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(shape[0])).astype(np.float32)
    fan_in, rows = shape
    scale = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(fan_in)
    return (scale * rng.standard_normal((rows, fan_in))).astype(np.float32)


def encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 rows -> raw GGUF bytes (rows, row_bytes), by gguf-py's quantizers."""
    if qtype == QT.F32:
        data = values.astype(np.float32)
    elif qtype == QT.F16:
        data = values.astype(np.float16)
    elif qtype in (QT.BF16, QT.Q8_0):
        data = quantize(values, qtype)
    else:
        raise ValueError(f"fixtures write {', '.join(t.name for t in WRITABLE_WEIGHT_TYPES)} from values; "
                         f"{qtype.name} comes from llama.cpp's quantizer or write_random_blocks")
    return np.ascontiguousarray(data).view(np.uint8).reshape(values.shape[0] if values.ndim > 1 else 1, -1)


def random_blocks(rows: int, row_length: int, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Random bytes that decode to finite, moderately scaled values in `qtype`."""
    if qtype in (QT.F32, QT.F16, QT.BF16):
        return encode((rng.standard_normal((rows, row_length)) / np.sqrt(row_length)).astype(np.float32), qtype)
    n_blocks = rows * (row_length // block_size(qtype))
    blocks = np.frombuffer(rng.bytes(n_blocks * block_bytes(qtype)), dtype=np.uint8)
    blocks = blocks.reshape(n_blocks, block_bytes(qtype)).copy()

    def f16_scales(lo, hi):
        return rng.uniform(lo, hi, n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)

    if qtype == QT.Q8_0:
        blocks[:, 0:2] = f16_scales(1e-3, 4e-3)
    elif qtype in (QT.Q4_K, QT.Q5_K):
        blocks[:, 0:2] = f16_scales(1e-4, 4e-4)
        blocks[:, 2:4] = f16_scales(1e-4, 4e-4)
    elif qtype == QT.Q6_K:
        blocks[:, 208:210] = f16_scales(1e-4, 4e-4)
    elif qtype == QT.NVFP4:
        blocks[:, 0:4] = rng.integers(0x08, 0x38, size=(n_blocks, 4), dtype=np.uint8)  # normal UE4M3
    else:
        raise ValueError(f"no random block generator for {qtype.name}")
    return blocks.reshape(rows, -1)


# ---- writing -------------------------------------------------------------------------

Producer = Callable[[str, tuple, QT], "np.ndarray | None"]


def chat_template() -> str:
    return resources.files("muse_mlx").joinpath("templates/fixture-chat.jinja").read_text(encoding="utf-8")


def _write_metadata(w: GGUFWriter, g: Geometry, name: str, vocab: FixtureVocab | None) -> None:
    k = lambda s: f"{ARCH}.{s}"  # noqa: E731
    w.add_name(name)
    w.add_uint32(k("block_count"), g.n_layer)
    w.add_uint32(k("context_length"), g.context_length)
    w.add_uint32(k("embedding_length"), g.n_embd)
    w.add_uint32(k("feed_forward_length"), g.n_ff)
    w.add_uint32(k("attention.head_count"), g.n_head)
    w.add_uint32(k("attention.head_count_kv"), g.n_head_kv)
    w.add_uint32(k("attention.key_length"), g.head_dim)
    w.add_uint32(k("attention.value_length"), g.head_dim)
    w.add_float32(k("attention.layer_norm_rms_epsilon"), g.rms_eps)
    w.add_uint32(k("attention.sliding_window"), g.sliding_window)
    w.add_array(k("attention.sliding_window_pattern"), [bool(s) for s in g.swa_layers])
    w.add_float32(k("rope.freq_base"), g.rope_base)
    w.add_float32(k("rope.freq_base_swa"), g.rope_base_swa)
    w.add_uint32(k("rope.dimension_count"), g.rope_dim)
    w.add_float32(k("logit_scale"), g.logit_scale)
    if g.final_logit_softcap:
        w.add_float32(k("final_logit_softcapping"), g.final_logit_softcap)

    vocab = vocab or build_vocab(g.n_vocab)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    bos, eot, eom = (vocab.id_of(t) for t in SPECIAL_TOKENS[:3])
    w.add_uint32("tokenizer.ggml.bos_token_id", bos)
    w.add_uint32("tokenizer.ggml.eos_token_id", eot)
    w.add_uint32("tokenizer.ggml.eot_token_id", eot)
    w.add_uint32("tokenizer.ggml.eom_token_id", eom)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.chat_template", chat_template())


def write_gguf(path: Path, g: Geometry, types: dict[str, QT], producer: Producer, name: str,
               vocab: FixtureVocab | None = None) -> Path:
    """Write header, metadata and tensor table, then each tensor's bytes from `producer`
    (None leaves a hole: the file stays sparse there). vocab: the fixtures' byte-level BPE of
    g.n_vocab tokens unless given. Atomic: tmp file + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shapes = g.tensor_shapes()
    w = GGUFWriter(tmp, ARCH)
    try:
        _write_metadata(w, g, name, vocab)
        for tname, shape in shapes.items():
            qtype = types[tname]
            rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            nbytes = rows * row_bytes(qtype, shape[0])
            w.add_tensor_info(tname, tuple(reversed(shape)), np.dtype(np.float32), nbytes, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        w.write_padding(f, f.tell())
        for tname, shape in shapes.items():
            qtype = types[tname]
            rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            nbytes = rows * row_bytes(qtype, shape[0])
            data = producer(tname, shape, qtype)
            if data is None:
                f.seek(nbytes, os.SEEK_CUR)
            else:
                if data.nbytes != nbytes:
                    raise AssertionError(f"{tname}: producer gave {data.nbytes} bytes, expected {nbytes}")
                data.tofile(f)
            pad = GGUFWriter.ggml_pad(nbytes, w.data_alignment) - nbytes
            f.seek(pad, os.SEEK_CUR)
        f.truncate()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_fixture(path, geometry: Geometry = DEFAULT_GEOMETRY, seed: int = DEFAULT_SEED,
                  weight_type: QT = QT.F32) -> Path:
    """A deterministic synthetic model: matrices in `weight_type` (F32/F16/BF16/Q8_0), norms F32."""
    if weight_type not in WRITABLE_WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {[t.name for t in WRITABLE_WEIGHT_TYPES]}, got {weight_type}")
    types = uniform_types(geometry, weight_type)

    def producer(name, shape, qtype):
        return encode(synthetic_values(geometry, name, seed), qtype)

    return write_gguf(path, geometry, types, producer, f"muse-glimmer synthetic fixture seed {seed}")


def write_random_blocks(path, geometry: Geometry, types: dict[str, QT], seed: int = 0) -> Path:
    """Random valid blocks in any type mix (benchmarks: the numbers they give are synthetic)."""

    def producer(name, shape, qtype):
        if len(shape) == 1:
            return encode(synthetic_values(geometry, name, seed), QT.F32)
        return random_blocks(shape[1], shape[0], qtype, _rng(seed, name))

    return write_gguf(path, geometry, types, producer, f"muse-glimmer random blocks seed {seed}")


def write_sparse(path, geometry: Geometry, types: dict[str, QT]) -> Path:
    """Header, metadata and tensor table; tensor data left as a hole (all zeros, no disk)."""
    return write_gguf(path, geometry, types, lambda *a: None, "muse-glimmer sparse header")


# ---- the default fixture -------------------------------------------------------------


def cache_dir() -> Path:
    """The user cache folder (XDG's convention): $XDG_CACHE_HOME/muse_mlx, else ~/.cache/muse_mlx."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")) / "muse_mlx"


def fixture_name(geometry: Geometry, seed: int, weight_type: QT) -> str:
    digest = hashlib.sha256(repr((FIXTURE_FORMAT_VERSION, geometry, seed, weight_type.name)).encode()).hexdigest()
    return f"muse-glimmer-fixture-{weight_type.name.lower()}-s{seed}-{digest[:12]}.gguf"


def ensure_fixture(geometry: Geometry = DEFAULT_GEOMETRY, seed: int = DEFAULT_SEED,
                   weight_type: QT = QT.F32, directory: Path | None = None) -> Path:
    """The fixture's path in the cache, written on first use (deterministic, so safe to share)."""
    path = Path(directory or cache_dir()) / fixture_name(geometry, seed, weight_type)
    if not path.exists():
        write_fixture(path, geometry, seed, weight_type)
    return path

