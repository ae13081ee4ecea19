"""Byte-level GGUF mutation for the hostile-input tests (tests only; the inputs are our own fixtures).

`Layout.of(data)` maps a *trusted* GGUF's header: where each key, type, count, value and
tensor-table field sits. Mutations then edit those bytes directly (a count, an offset, a
type, a value) or splice a new value in (`splice_kv`, which re-pads the data section so
the rest of the file stays valid). Nothing here goes through gguf-py's writer, so a
mutant costs a bytes copy, not a re-serialization.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf.constants import GGML_QUANT_SIZES

SCALAR = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
          VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


@dataclass
class KV:
    key: str
    start: int  # the key's length field
    type_at: int  # the value type field
    value_at: int  # the value (for arrays: the element type field)
    end: int
    vtype: VT
    sub: VT | None = None
    count_at: int | None = None  # arrays: the element count field
    count: int = 1
    elements: list[int] = field(default_factory=list)  # arrays of strings: each element's length field


@dataclass
class TensorInfo:
    name: str
    start: int
    n_dims_at: int
    dims_at: list[int]
    type_at: int
    offset_at: int
    end: int
    ne: tuple[int, ...]
    qtype: QT
    offset: int  # relative to the data section

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.ne, dtype=np.int64)) // block * size


@dataclass
class Layout:
    kv: dict[str, KV]
    tensors: list[TensorInfo]
    kv_end: int
    table_end: int
    data_start: int
    alignment: int

    @classmethod
    def of(cls, data: bytes) -> "Layout":
        pos = 24
        n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

        def string(pos):
            (n,) = struct.unpack_from("<Q", data, pos)
            return data[pos + 8:pos + 8 + n].decode(), pos + 8 + n

        kv = {}
        alignment = 32
        for _ in range(n_kv):
            start = pos
            key, pos = string(pos)
            type_at = pos
            vtype = VT(struct.unpack_from("<I", data, pos)[0])
            pos += 4
            entry = KV(key, start, type_at, pos, 0, vtype)
            if vtype == VT.STRING:
                _, pos = string(pos)
            elif vtype == VT.ARRAY:
                entry.sub = VT(struct.unpack_from("<I", data, pos)[0])
                entry.count_at = pos + 4
                entry.count = struct.unpack_from("<Q", data, pos + 4)[0]
                pos += 12
                for _ in range(entry.count):
                    if entry.sub == VT.STRING:
                        entry.elements.append(pos)
                        _, pos = string(pos)
                    else:
                        pos += struct.calcsize(SCALAR[entry.sub])
            else:
                if key == "general.alignment":
                    alignment = struct.unpack_from("<I", data, pos)[0]
                pos += struct.calcsize(SCALAR[vtype])
            entry.end = pos
            kv[key] = entry
        kv_end = pos
        tensors = []
        for _ in range(n_tensors):
            start = pos
            name, pos = string(pos)
            n_dims_at = pos
            (n_dims,) = struct.unpack_from("<I", data, pos)
            pos += 4
            dims_at = [pos + 8 * j for j in range(n_dims)]
            ne = struct.unpack_from(f"<{n_dims}Q", data, pos)
            pos += 8 * n_dims
            type_at = pos
            qtype = QT(struct.unpack_from("<I", data, pos)[0])
            offset_at = pos + 4
            (offset,) = struct.unpack_from("<Q", data, pos + 4)
            pos += 12
            tensors.append(TensorInfo(name, start, n_dims_at, dims_at, type_at, offset_at, pos, ne, qtype, offset))
        data_start = -(-pos // alignment) * alignment
        return cls(kv, tensors, kv_end, pos, data_start, alignment)

    def tensor(self, name: str) -> TensorInfo:
        return next(t for t in self.tensors if t.name == name)

    def tensor_bytes_at(self, name: str) -> int:
        return self.data_start + self.tensor(name).offset


# ---- encoders ----------------------------------------------------------------------------


def enc_str(s: bytes | str) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def enc_scalar(vtype: VT, value) -> bytes:
    return struct.pack("<I", vtype) + struct.pack(SCALAR[vtype], value)


def enc_string_value(s: bytes | str) -> bytes:
    return struct.pack("<I", VT.STRING) + enc_str(s)


def enc_array(sub: VT, items, count: int | None = None) -> bytes:
    """An ARRAY value; `count` overrides the element count written (to lie about it)."""
    items = list(items)
    head = struct.pack("<IIQ", VT.ARRAY, sub, len(items) if count is None else count)
    if sub == VT.STRING:
        return head + b"".join(enc_str(x) for x in items)
    return head + b"".join(struct.pack(SCALAR[sub], x) for x in items)


# ---- edits -------------------------------------------------------------------------------


def put(data: bytes, at: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def splice_kv(data: bytes, key: str, value: bytes | None, new_key: bytes | None = None) -> bytes:
    """Replace `key`'s type+value bytes with `value` (None drops the pair; a key not in the
    file is appended), optionally renaming it to raw `new_key`; re-pads the data section."""
    lay = Layout.of(data)
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    head = bytearray(data[:24])
    kvs = b""
    found = False
    for k, e in lay.kv.items():
        if k == key:
            found = True
            if value is None:
                n_kv -= 1
                continue
            kvs += enc_str(new_key if new_key is not None else k.encode()) + value
        else:
            kvs += data[e.start:e.end]
    if not found and value is not None:
        kvs += enc_str(new_key if new_key is not None else key.encode()) + value
        n_kv += 1
    struct.pack_into("<QQ", head, 8, n_tensors, n_kv)
    table = data[lay.kv_end:lay.table_end]
    out = bytes(head) + kvs + table
    out += b"\0" * (-len(out) % lay.alignment)
    return out + data[lay.data_start:]


def set_tensor_values(data: bytes, name: str, index: int, value: float) -> bytes:
    """Set element `index` of an F32/F16/BF16 tensor, or the first f16 scale of block `index`
    of a Q8_0/Q4_K/Q5_K/Q6_K tensor, to `value`."""
    lay = Layout.of(data)
    t = lay.tensor(name)
    at = lay.data_start + t.offset
    b = bytearray(data)
    with np.errstate(over="ignore"):  # 3e38 as f16 is inf, on purpose
        return _set_value(b, t, at, index, value)


def _set_value(b: bytearray, t: TensorInfo, at: int, index: int, value: float) -> bytes:
    if t.qtype == QT.F32:
        struct.pack_into("<f", b, at + 4 * index, value)
    elif t.qtype == QT.F16:
        b[at + 2 * index:at + 2 * index + 2] = np.float16(value).tobytes()
    elif t.qtype == QT.BF16:
        b[at + 2 * index:at + 2 * index + 2] = (np.float32(value).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        block_bytes = GGML_QUANT_SIZES[t.qtype][1]
        scale_at = {QT.Q8_0: 0, QT.Q4_K: 0, QT.Q5_K: 0, QT.Q6_K: 208}[t.qtype]
        p = at + block_bytes * index + scale_at
        b[p:p + 2] = np.float16(value).tobytes()
    return bytes(b)


# ---- the fuzzer's mutations --------------------------------------------------------------

EDGE_U64 = (0, 1, 2, 3, 31, 32, 33, 255, 256, 4095, 65_535, 65_536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
            2**62, 2**63 - 1, 2**63, 2**64 - 1)
EDGE_U32 = (0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 14, 15, 30, 31, 39, 40, 255, 256, 65_535, 2**31 - 1, 2**31,
            2**32 - 1)
EDGE_F32 = (0.0, -0.0, 1e-45, 1e-38, 1e-12, 0.5, 1.0, -1.0, 2.0, 1e4, 1e6, 3e38, -3e38,
            float("inf"), float("-inf"), float("nan"))


def _region_flip(rng: random.Random, data: bytes, lay: Layout):
    regions = {"fixed": (0, 24), "kv": (24, lay.kv_end), "table": (lay.kv_end, lay.table_end),
               "data": (lay.data_start, len(data))}
    name = rng.choice(sorted(regions))
    lo, hi = regions[name]
    b = bytearray(data)
    n = rng.choice((1, 1, 2, 4, 16))
    for _ in range(n):
        i = rng.randrange(lo, hi)
        b[i] = rng.choice((b[i] ^ (1 << rng.randrange(8)), 0x00, 0xFF, rng.randrange(256)))
    return f"flip {n} byte(s) in {name}", bytes(b)


def _truncate(rng: random.Random, data: bytes, lay: Layout):
    cut = rng.choice((rng.randrange(0, lay.kv_end), rng.randrange(lay.kv_end, lay.data_start + 1),
                      rng.randrange(lay.data_start, len(data)), len(data) - rng.randrange(1, 64)))
    return f"truncate at {cut}", data[:cut]


def _count(rng: random.Random, data: bytes, lay: Layout):
    arrays = [e for e in lay.kv.values() if e.count_at is not None]
    strings = [e for e in lay.kv.values() if e.vtype == VT.STRING]
    choice = rng.randrange(5)
    v = rng.choice(EDGE_U64) if rng.random() < 0.7 else rng.randrange(2**64)
    if choice == 0:
        return f"tensor count = {v}", put(data, 8, "<Q", v)
    if choice == 1:
        return f"kv count = {v}", put(data, 16, "<Q", v)
    if choice == 2:
        e = rng.choice(arrays)
        if rng.random() < 0.5:
            v = max(0, e.count + rng.choice((-1, 1, -e.count, e.count)))
        return f"{e.key} count = {v}", put(data, e.count_at, "<Q", v)
    if choice == 3:
        e = rng.choice(strings)
        return f"{e.key} string length = {v}", put(data, e.value_at, "<Q", v)
    e = rng.choice([e for e in arrays if e.elements] or arrays)
    if not e.elements:
        return "no string array", data
    j = rng.randrange(len(e.elements))
    return f"{e.key}[{j}] length = {v}", put(data, e.elements[j], "<Q", v)


def _tensor_field(rng: random.Random, data: bytes, lay: Layout):
    t = rng.choice(lay.tensors)
    choice = rng.randrange(4)
    if choice == 0:  # offset
        others = [u.offset for u in lay.tensors]
        v = rng.choice((2**64 - 1, 2**63, t.offset + 1, t.offset + 32, max(t.offset - 32, 0), t.offset + 16,
                        rng.choice(others), len(data), rng.randrange(2**64)))
        return f"{t.name} offset = {v}", put(data, t.offset_at, "<Q", v)
    if choice == 1:  # type
        v = rng.choice([int(q) for q in GGML_QUANT_SIZES] + [4, 5, 99, 2**31, 2**32 - 1])
        return f"{t.name} type = {v}", put(data, t.type_at, "<I", v)
    if choice == 2:  # n_dims
        v = rng.choice((0, 1, 3, 4, 5, 2**32 - 1))
        return f"{t.name} n_dims = {v}", put(data, t.n_dims_at, "<I", v)
    j = rng.randrange(len(t.dims_at))
    v = rng.choice(EDGE_U64 + (t.ne[j] * 2, t.ne[j] // 2, t.ne[j] + 1))
    return f"{t.name} ne[{j}] = {v}", put(data, t.dims_at[j], "<Q", v)


def _kv_type(rng: random.Random, data: bytes, lay: Layout):
    e = rng.choice(list(lay.kv.values()))
    if e.sub is not None and rng.random() < 0.5:
        v = rng.choice((VT.ARRAY, VT.STRING, VT.BOOL, VT.UINT64, 13, 2**32 - 1))
        return f"{e.key} element type = {v}", put(data, e.value_at, "<I", int(v))
    v = rng.choice(list(range(14)) + [2**31, 2**32 - 1])
    return f"{e.key} type = {v}", put(data, e.type_at, "<I", v)


def _kv_value(rng: random.Random, data: bytes, lay: Layout):
    scalars = [e for e in lay.kv.values() if e.vtype in (VT.UINT32, VT.FLOAT32, VT.BOOL)]
    e = rng.choice(scalars)
    if e.vtype == VT.UINT32:
        v = rng.choice(EDGE_U32)
        return f"{e.key} = {v}", put(data, e.value_at, "<I", v)
    if e.vtype == VT.FLOAT32:
        v = rng.choice(EDGE_F32)
        return f"{e.key} = {v}", put(data, e.value_at, "<f", v)
    v = rng.randrange(256)
    return f"{e.key} = byte {v}", put(data, e.value_at, "<B", v)


def _tensor_value(rng: random.Random, data: bytes, lay: Layout):
    t = rng.choice(lay.tensors)
    block = GGML_QUANT_SIZES[t.qtype][0]
    n = int(np.prod(t.ne, dtype=np.int64)) // block
    if t.qtype not in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K):
        return "unsupported", data
    i = rng.randrange(n)
    v = rng.choice(EDGE_F32 + (6e4, 65504.0))
    return f"{t.name}[{i}] = {v}", set_tensor_values(data, t.name, i, v)


def _payload(rng: random.Random, data: bytes, lay: Layout):
    tokens = lay.kv["tokenizer.ggml.tokens"]
    toks = [data[p + 8:p + 8 + struct.unpack_from("<Q", data, p)[0]] for p in tokens.elements]
    choice = rng.randrange(9)
    if choice == 0:
        i, j = rng.randrange(len(toks)), rng.randrange(len(toks))
        toks[i] = toks[j]
        return f"token {i} = token {j}", splice_kv(data, "tokenizer.ggml.tokens", enc_array(VT.STRING, toks))
    if choice == 1:
        i = rng.randrange(len(toks))
        toks[i] = rng.choice((b"\xff", b"\xc3", b"a\x80b", b"\xed\xa0\x80", b""))
        return f"token {i} = {toks[i]!r}", splice_kv(data, "tokenizer.ggml.tokens", enc_array(VT.STRING, toks))
    if choice == 2 and "tokenizer.ggml.merges" in lay.kv:
        merges = lay.kv["tokenizer.ggml.merges"]
        ms = [data[p + 8:p + 8 + struct.unpack_from("<Q", data, p)[0]] for p in merges.elements]
        i = rng.randrange(len(ms))
        ms[i] = rng.choice((b"zz", b"a b c", b"zz yy", b" ", b"a  b", b"\xff \xfe", ms[i].replace(b" ", b""),
                            b"", b"\xc4\xa0 zz"))
        return f"merge {i} = {ms[i]!r}", splice_kv(data, "tokenizer.ggml.merges", enc_array(VT.STRING, ms))
    if choice == 3:
        return "architecture invalid UTF-8", splice_kv(data, "general.architecture",
                                                       enc_string_value(b"muse-gl\xffimmer"))
    if choice == 4:
        return "key invalid UTF-8", splice_kv(data, "general.name", enc_string_value("x"), new_key=b"gen\xff")
    templates = (b"{{ 1/0 }}", b"{% for %}", b"\xff\xfe{{ x }}", b"{{ 'x' * 10**10 }}",
                 b"{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}", b"{{ 10.0 ** 400 }}",
                 b"{{ ''.__class__.__mro__[1].__subclasses__() }}", b"{{ [] + 1 }}", b"{{ messages[99] }}x",
                 b"{% for m in messages %}{{ m.content }}{% endfor %}", b"")
    t = rng.choice(templates)
    return f"chat template = {t!r}", splice_kv(data, "tokenizer.chat_template", enc_string_value(t))


MUTATORS = (_region_flip, _truncate, _count, _tensor_field, _kv_type, _kv_value, _tensor_value, _payload)


def mutants(data: bytes, seed: int, n: int):
    """`n` seeded mutants of `data`: (description, bytes)."""
    rng = random.Random(seed)
    lay = Layout.of(data)
    for i in range(n):
        mutator = MUTATORS[i % len(MUTATORS)] if i < len(MUTATORS) else rng.choice(MUTATORS)
        desc, out = mutator(rng, data, lay)
        yield f"{mutator.__name__.strip('_')}: {desc}", out
