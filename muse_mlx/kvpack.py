"""kvpack: a slot's KV cache as a sealed, portable artifact (docs/kvpack.md).

A pack is a directory: `manifest.json` (what the rows are: model, geometry, encoding, token
ids, the blobs and a seal) and `blobs/<sha256>.safetensors`, content-addressed: the full
layers' rows in chunks of positions (shared by packs with a common prefix), the sliding
layers' rings in groups of 13, each ring as stored (its rotation is the offset).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import io
from safetensors.numpy import save as st_save

from .errors import MuseError
from .geometry import Geometry
from .kv import KV_DTYPE, SlotCache

FORMAT = "muse-kvpack/2"
ENCODINGS = {"f16": np.float16, "f32": np.float32}
CHUNK_ROWS = 256          # positions per plane chunk: the unit a common prefix shares
READ_THREADS = min(8, os.cpu_count() or 1)   # blobs read and hashed at once by a restore or verify
RING_GROUP = 13           # sliding layers per ring blob (the book's transfer schedule: 39 = 3 x 13)
MANIFEST_MAX_BYTES = 64 * 2**20
FINGERPRINT_PIECE = 64 * 2**20   # the model fingerprint's pieces (file_digest)
FINGERPRINT_SCHEME = "sha256/64MiB"
HEADER_MAX_BYTES = 2**20   # a blob's safetensors header (one tensor: ~100 B)


class PackError(MuseError):
    """A pack that is not what it claims, or not for this model."""


# ---- the model's identity ------------------------------------------------------------------


def file_digest(path: Path, piece: int = FINGERPRINT_PIECE, threads: int = READ_THREADS) -> str:
    """SHA-256 over the file's size (8 bytes, little-endian) followed by the SHA-256 of each of its
    `piece`-byte pieces in order (the last one shorter): one read of the file, the pieces hashed on
    `threads` threads (one SHA-256 stream runs at ~0.9 GB/s on the H200's host: 18 s for the
    16.9 GB bench file, docs/ledger.md 2026-12-02)."""
    size = path.stat().st_size
    local = threading.local()

    def one(i: int) -> bytes:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(piece)
        view = memoryview(buf)[:min(piece, size - i * piece)]
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], i * piece + done)
            if n <= 0:
                raise OSError(f"{path} ended at byte {i * piece + done:,} while being hashed")
            done += n
        return hashlib.sha256(view).digest()
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            digests = list(pool.map(one, range(max(1, -(-size // piece)))))
    finally:
        os.close(fd)
    return hashlib.sha256(size.to_bytes(8, "little") + b"".join(digests)).hexdigest()


def fingerprint(path, cache_dir: Path | None = None) -> str:
    """The GGUF's identity: FINGERPRINT_SCHEME + ":" + file_digest over its bytes (metadata,
    tensor table, tensor data), cached per file by (scheme, real path, size, mtime, inode) in
    `cache_dir`'s fingerprints.json (None: not cached)."""
    path = Path(path).resolve()
    if cache_dir is None:
        return f"{FINGERPRINT_SCHEME}:{file_digest(path)}"
    st = path.stat()
    key = f"{FINGERPRINT_SCHEME}|{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    index = Path(cache_dir) / "fingerprints.json"
    try:
        known = json.loads(index.read_text())
        if isinstance(known, dict) and isinstance(known.get(key), str):
            return known[key]
    except (OSError, ValueError, RecursionError):
        known = {}
    digest = f"{FINGERPRINT_SCHEME}:{file_digest(path)}"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        known = known if isinstance(known, dict) else {}
        known[key] = digest
        _write_atomic(index, json.dumps(known, sort_keys=True).encode())
    except OSError:
        pass   # a read-only cache folder costs a recomputation next time, nothing else
    return digest


# ---- the manifest --------------------------------------------------------------------------


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal_of(manifest: dict) -> str:
    return "sha256:" + hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "seal"})).hexdigest()


def geometry_fields(g: Geometry) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(g).items()}


def payload_bytes(manifest: dict) -> int:
    """The pack's K/V row bytes: every held row of every layer, at the encoding's width."""
    g = manifest["geometry"]
    width = np.dtype(ENCODINGS[manifest["encoding"]]).itemsize
    row = 2 * g["n_head_kv"] * g["head_dim"] * width
    rings = sum(len(grp["layers"]) for grp in manifest["ring_groups"]) * manifest["ring_rows_held"]
    return (len(_full_layers(g)) * manifest["offset"] + rings) * row


def _full_layers(g: dict) -> list[int]:
    return [i for i, swa in enumerate(g["swa_layers"]) if not swa]


def _swa_layers(g: dict) -> list[int]:
    return [i for i, swa in enumerate(g["swa_layers"]) if swa]


# ---- save ---------------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _put_blob(blobs: Path, tensors: dict[str, np.ndarray]) -> tuple[str, int]:
    data = st_save(tensors)
    name = hashlib.sha256(data).hexdigest()
    target = blobs / f"{name}.safetensors"
    if not target.exists():
        _write_atomic(target, data)
    return name, len(data)


def save(cache: SlotCache, tokens, model_id: dict, out, encoding: str = "f16", chunk_rows: int = CHUNK_ROWS,
         known_chunks: dict | None = None, last_logits=None) -> Path:
    """Write `cache` (holding exactly `tokens`) as a pack at `out` (a new or empty directory).
    model_id: {'fingerprint': ..., 'architecture': ...}. The manifest is written last.
    known_chunks: {(first, rows): (blob name, bytes)} of plane chunks of this same cache already
    written by an earlier save into `out`'s blobs (the prompt cache's checkpoints); they are not
    serialized again. last_logits: the logits (n_vocab,) the forward gave at the last position,
    kept float32 whatever the encoding (the prompt cache's end entries: a repeated prompt then
    samples its first token from them, with no prefill)."""
    if encoding not in ENCODINGS:
        raise PackError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    tokens = [int(t) for t in tokens]
    if len(tokens) != cache.offset:
        raise PackError(f"the cache holds {cache.offset} positions but {len(tokens)} token ids were given")
    if cache.dtype != KV_DTYPE:
        raise PackError("only an f16 cache (the live contract) can be packed")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(p.name != "blobs" for p in out.iterdir())):
        raise PackError(f"{out}: exists and is not an empty directory")
    g, dt = cache.geometry, ENCODINGS[encoding]
    blobs = out / "blobs"
    try:
        blobs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PackError(f"{out}: cannot create the pack ({exc.strerror})") from None

    def arr(a) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(a).astype(dt, copy=False))

    full = [i for i in range(g.n_layer) if not g.is_swa(i)]
    swa = [i for i in range(g.n_layer) if g.is_swa(i)]
    chunks, to_write = [], []
    for p0 in range(0, cache.offset, chunk_rows):
        n = min(chunk_rows, cache.offset - p0)
        chunks.append({"first": p0, "rows": n})
        known = known_chunks.get((p0, n)) if known_chunks and encoding == "f16" else None
        if known and (blobs / f"{known[0]}.safetensors").exists():
            chunks[-1].update(blob=known[0], bytes=known[1])
        else:
            to_write.append(chunks[-1])
    # The rows to serialize, read out of MLX once a layer (not once a chunk), from the first
    # chunk not already written; the blobs are then serialized, hashed and written on threads,
    # a bounded number at a time.
    lo = to_write[0]["first"] if to_write else cache.offset
    rows = {i: np.array(cache.layers[i].kv[:, :, lo:cache.offset, :]) for i in full} if to_write else {}
    groups = [{"layers": swa[a:a + RING_GROUP]} for a in range(0, len(swa), RING_GROUP)]
    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        pending = []

        def put(entry: dict, tensors: dict) -> None:
            pending.append((entry, pool.submit(_put_blob, blobs, tensors)))
            while len(pending) > 2 * READ_THREADS:
                done, future = pending.pop(0)
                done["blob"], done["bytes"] = future.result()

        for c in to_write:
            a, b = c["first"] - lo, c["first"] - lo + c["rows"]
            put(c, {"kv": arr(np.stack([rows[i][:, :, a:b, :] for i in full]))})
        for grp in groups:
            put(grp, {"kv": arr(np.stack([np.array(cache.layers[i].kv[:, :, :cache.layers[i].held, :])
                                         for i in grp["layers"]]))})
        for entry, future in pending:
            entry["blob"], entry["bytes"] = future.result()
    chunks = [{"first": c["first"], "rows": c["rows"], "blob": c["blob"], "bytes": c["bytes"]} for c in chunks]
    groups = [{"layers": grp["layers"], "blob": grp["blob"], "bytes": grp["bytes"]} for grp in groups]
    manifest = {
        "format": FORMAT, "model": dict(model_id), "geometry": geometry_fields(g), "context": cache.context,
        "encoding": encoding, "offset": cache.offset, "tokens": tokens, "chunk_rows": chunk_rows,
        "ring_rows_held": min(cache.offset, g.ring_rows(cache.context)) if swa else 0,
        "plane_chunks": chunks, "ring_groups": groups,
    }
    if last_logits is not None:
        logits = np.ascontiguousarray(np.array(last_logits, dtype=np.float32).reshape(-1))
        if logits.shape != (g.n_vocab,) or not np.isfinite(logits).all() or not tokens:
            raise PackError(f"last_logits must be {g.n_vocab} finite values after at least one token")
        name, size = _put_blob(blobs, {"logits": logits})
        manifest["last_logits"] = {"blob": name, "bytes": size}
    manifest["seal"] = seal_of(manifest)
    _write_atomic(out / "manifest.json", _canonical(manifest))
    return out


# ---- read and verify ------------------------------------------------------------------------


@dataclass(frozen=True)
class Pack:
    path: Path
    manifest: dict

    @property
    def tokens(self) -> list[int]:
        return self.manifest["tokens"]

    def blob_names(self) -> set[str]:
        m = self.manifest
        names = {c["blob"] for c in m["plane_chunks"]} | {r["blob"] for r in m["ring_groups"]}
        return names | ({m["last_logits"]["blob"]} if "last_logits" in m else set())


def _need(cond: bool, path, what: str) -> None:
    if not cond:
        raise PackError(f"{path}: {what}")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_manifest(path) -> Pack:
    """The manifest, bounded, parsed and checked for form and seal (no blob is read)."""
    path = Path(path)
    mf = path / "manifest.json"
    try:
        size = mf.stat().st_size
    except OSError as exc:
        raise PackError(f"{path}: not a pack ({mf.name}: {exc.strerror})") from None
    _need(size <= MANIFEST_MAX_BYTES, path, f"manifest.json is {size:,} bytes, more than {MANIFEST_MAX_BYTES:,}")
    try:
        m = json.loads(mf.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PackError(f"{path}: manifest.json is not JSON ({type(exc).__name__})") from None
    _need(isinstance(m, dict), path, "manifest.json is not an object")
    _need(m.get("format") == FORMAT, path, f"format is {m.get('format')!r}, not {FORMAT!r}")
    _need(m.get("seal") == seal_of(m), path, "the seal does not match the manifest (changed or cut)")
    model, g = m.get("model"), m.get("geometry")
    _need(isinstance(model, dict) and isinstance(model.get("fingerprint"), str), path, "model.fingerprint missing")
    _need(isinstance(g, dict), path, "geometry missing")
    try:
        geometry = Geometry(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items()})
    except (TypeError, ValueError, MuseError) as exc:
        raise PackError(f"{path}: geometry is not a muse-glimmer geometry ({exc})") from None
    _need(m.get("encoding") in ENCODINGS, path, f"encoding {m.get('encoding')!r} is not one of {', '.join(ENCODINGS)}")
    offset, context, chunk_rows = m.get("offset"), m.get("context"), m.get("chunk_rows")
    _need(_int(context) and 1 <= context <= geometry.context_length, path,
          f"context {context!r} is not 1..{geometry.context_length}")
    _need(_int(offset) and 0 <= offset <= context, path, f"offset {offset!r} is not 0..{context}")
    _need(_int(chunk_rows) and chunk_rows >= 1, path, f"chunk_rows {chunk_rows!r} is not a positive integer")
    tokens = m.get("tokens")
    _need(isinstance(tokens, list) and len(tokens) == offset, path,
          f"the token list does not hold {offset} ids")
    _need(set(map(type, tokens)) <= {int} and (not tokens or 0 <= min(tokens) <= max(tokens) < geometry.n_vocab), path,
          f"a token id is not an integer in 0..{geometry.n_vocab - 1}")
    held = min(offset, geometry.ring_rows(context)) if geometry.n_swa else 0
    _need(m.get("ring_rows_held") == held, path, f"ring_rows_held is {m.get('ring_rows_held')!r}, not {held}")
    chunks = m.get("plane_chunks")
    _need(isinstance(chunks, list), path, "plane_chunks missing")
    at = 0
    for c in chunks:
        _need(isinstance(c, dict) and c.get("first") == at and _int(c.get("rows"))
              and 1 <= c["rows"] <= chunk_rows and _is_name(c.get("blob")), path,
              f"plane chunk at position {at} is malformed or out of order")
        at += c["rows"]
    _need(at == offset if geometry.n_full else not chunks, path, f"the plane chunks cover {at} positions, not {offset}")
    groups = m.get("ring_groups")
    _need(isinstance(groups, list), path, "ring_groups missing")
    seen = []
    for grp in groups:
        _need(isinstance(grp, dict) and isinstance(grp.get("layers"), list) and _is_name(grp.get("blob"))
              and all(_int(i) for i in grp["layers"]), path, "a ring group is malformed")
        seen += grp["layers"]
    _need(seen == [i for i in range(geometry.n_layer) if geometry.is_swa(i)], path,
          "the ring groups do not cover the sliding layers exactly once, in order")
    if "last_logits" in m:
        ll = m["last_logits"]
        _need(isinstance(ll, dict) and _is_name(ll.get("blob")) and offset >= 1, path, "last_logits is malformed")
    return Pack(path, m)


def _is_name(v) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(ch in "0123456789abcdef" for ch in v)


def _geometry(pack: Pack) -> Geometry:
    return Geometry(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in pack.manifest["geometry"].items()})


def check_for_model(pack: Pack, geometry: Geometry, model_fingerprint: str) -> None:
    """The pack was made for this model: the same fingerprint and every geometry field."""
    m = pack.manifest
    _need(m["model"]["fingerprint"] == model_fingerprint, pack.path,
          f"made for model {m['model']['fingerprint'][:19]}..., not this one ({model_fingerprint[:19]}...)")
    mine = geometry_fields(geometry)
    diff = [k for k in mine if mine[k] != m["geometry"].get(k)] + [k for k in m["geometry"] if k not in mine]
    _need(not diff, pack.path, f"made for another geometry ({', '.join(sorted(diff))} differ)")


@dataclass(frozen=True)
class _Blob:
    """A blob whose bytes hashed to its name and whose header was checked: the bytes (the same
    object is handed to MLX, so what was checked is what is loaded) and its one tensor's place."""
    data: bytes | memoryview
    name: str
    dtype: np.dtype
    shape: tuple
    start: int

    def host(self) -> np.ndarray:
        """The tensor, a read-only view of the bytes."""
        count = int(np.prod(self.shape))
        return np.frombuffer(self.data, self.dtype, count, self.start).reshape(self.shape)

    def device(self) -> mx.array:
        """The tensor as an MLX array: loaded from the bytes by MLX (on a GPU, a copy to device
        memory, not to memory the host first writes)."""
        return mx.load(io.BytesIO(self.data), format="safetensors")[self.name]


_ST_DTYPES = {"F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}


def _tensor_header(data: bytes, pack: Pack, name: str) -> dict:
    """The safetensors header of a blob's bytes, checked for form: its tensors' dtypes, shapes and
    data offsets, which must tile the data exactly (no gap, no overlap, nothing past the end)."""
    tag = f"blob {name[:12]}..."
    _need(len(data) >= 8, pack.path, f"{tag} is not a safetensors file (shorter than its header's length)")
    n = int.from_bytes(data[:8], "little")
    _need(n <= min(HEADER_MAX_BYTES, len(data) - 8), pack.path, f"{tag} is not a safetensors file (its header "
          f"claims {n:,} bytes)")
    try:
        header = json.loads(bytes(data[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise PackError(f"{pack.path}: {tag} is not a safetensors file (its header is not JSON)") from None
    _need(isinstance(header, dict), pack.path, f"{tag} is not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    spans = []
    for key, t in header.items():
        ok = (isinstance(t, dict) and t.get("dtype") in _ST_DTYPES and isinstance(t.get("shape"), list)
              and all(_int(d) and d >= 0 for d in t["shape"]) and isinstance(t.get("data_offsets"), list)
              and len(t["data_offsets"]) == 2 and all(_int(o) for o in t["data_offsets"]))
        _need(ok, pack.path, f"{tag} is not a safetensors file (tensor {str(key)[:20]!r} is malformed)")
        first, end = t["data_offsets"]
        _need(end - first == int(np.prod(t["shape"], dtype=np.int64)) * _ST_DTYPES[t["dtype"]].itemsize,
              pack.path, f"{tag} is not a safetensors file (tensor {key[:20]!r}'s offsets do not fit its shape)")
        spans.append((first, end))
    at = 0
    for first, end in sorted(spans):
        _need(first == at, pack.path, f"{tag} is not a safetensors file (its tensors do not tile its data)")
        at = end
    _need(8 + n + at == len(data), pack.path, f"{tag} is not a safetensors file (its data is {len(data) - 8 - n:,} "
          f"bytes, its tensors {at:,})")
    for t in header.values():
        t["data_offsets"] = [8 + n + o for o in t["data_offsets"]]
    return header


def _blob_file(pack: Pack, name: str, shape: tuple, dtype=None) -> tuple[Path, int]:
    """A blob's file and size, the size bounded by what its tensor needs before anything is read."""
    f = pack.path / "blobs" / f"{name}.safetensors"
    need = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype or ENCODINGS[pack.manifest["encoding"]]).itemsize
    try:
        size = f.stat().st_size
    except OSError as exc:
        raise PackError(f"{pack.path}: blob {name[:12]}... is missing ({exc.strerror})") from None
    _need(need + 8 <= size <= need + 8 + HEADER_MAX_BYTES, pack.path, f"blob {name[:12]}... is {size:,} bytes; "
          f"its tensor needs {need:,} (changed or cut)")
    return f, size


def _check_blob(pack: Pack, name: str, data, key: str, shape: tuple, dtype=None) -> _Blob:
    """A blob's bytes (`data`: bytes or a memoryview) checked: hashed to its name, holding exactly one
    tensor `key` of `shape` at the encoding (or `dtype`); f32 values must be f16 values."""
    dt = np.dtype(dtype or ENCODINGS[pack.manifest["encoding"]])
    _need(hashlib.sha256(data).hexdigest() == name, pack.path, f"blob {name[:12]}... does not hash to its name "
          f"(changed or cut)")
    header = _tensor_header(data, pack, name)
    _need(list(header) == [key], pack.path, f"blob {name[:12]}... holds {sorted(header)[:4]}, not the one tensor "
          f"{key!r} the manifest implies")
    t = header[key]
    blob = _Blob(data, key, _ST_DTYPES[t["dtype"]], tuple(t["shape"]), t["data_offsets"][0])
    _need(blob.dtype == dt and blob.shape == tuple(shape), pack.path,
          f"blob {name[:12]}... tensor {key} is {blob.dtype} {blob.shape}, not {dt} {tuple(shape)}")
    if dtype is None and dt != np.float16:
        v = blob.host()
        _need(bool(np.array_equal(v.astype(np.float16).astype(dt), v, equal_nan=True)), pack.path,
              f"blob {name[:12]}... holds values f16 cannot represent exactly")
    return blob


def _read_blob(pack: Pack, name: str, key: str, shape: tuple, dtype=None) -> _Blob:
    """A blob read whole into host memory and checked (_blob_file, _check_blob)."""
    f, size = _blob_file(pack, name, shape, dtype)
    try:
        with open(f, "rb") as fh:
            data = fh.read(size + 1)
    except OSError as exc:
        raise PackError(f"{pack.path}: blob {name[:12]}... is missing ({exc.strerror})") from None
    return _check_blob(pack, name, data, key, shape, dtype)


def _wanted(pack: Pack) -> list[tuple[str, tuple]]:
    """(blob, tensor shape) of the plane chunks, then of the ring groups."""
    m, g = pack.manifest, _geometry(pack)
    n_kv, hd, n_full = g.n_head_kv, g.head_dim, g.n_layer - g.n_swa
    wanted = [(c["blob"], (n_full, 2, n_kv, c["rows"], hd)) for c in m["plane_chunks"]]
    return wanted + [(grp["blob"], (len(grp["layers"]), 2, n_kv, m["ring_rows_held"], hd)) for grp in m["ring_groups"]]


def _row_blobs(pack: Pack) -> list[_Blob]:
    """The plane chunks' and ring groups' blobs in host memory, every one checked (_read_blob),
    several at once: reading and SHA-256 release the GIL, so a pack is hashed on as many cores
    as threads."""
    wanted = _wanted(pack)
    if len(wanted) < 2:
        return [_read_blob(pack, name, "kv", shape) for name, shape in wanted]
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(wanted))) as pool:
        return list(pool.map(lambda w: _read_blob(pack, w[0], "kv", w[1]), wanted))


def _row_arrays(pack: Pack, upload=None) -> list[mx.array]:
    """The row blobs' tensors as MLX arrays, every blob checked before its bytes go to MLX, the
    checks of later blobs overlapping the loads of earlier ones. upload: a kernels.upload
    PinnedUpload (the blobs read into its page-locked staging, checked there and copied by the
    GPU from there; a pack with a blob larger than the staging's half takes the other way); None:
    each blob read into host memory, checked, and loaded by mx.load from
    those same bytes. Any refusal is raised before the caller makes storage of them."""
    wanted = _wanted(pack)
    dt = ENCODINGS[pack.manifest["encoding"]]
    files = [_blob_file(pack, name, shape) for name, shape in wanted]
    if upload is not None and all(size <= upload.half_bytes for _, size in files):
        from .kernels.upload import Piece

        def check(i: int, view: memoryview) -> tuple[int, int]:
            blob = _check_blob(pack, wanted[i][0], view, "kv", wanted[i][1])
            return blob.start, int(np.prod(blob.shape)) * blob.dtype.itemsize
        try:
            raw = upload.upload([Piece(f, 0, size) for f, size in files], check)
        except OSError as exc:
            raise PackError(f"{pack.path}: a blob cannot be read ({exc})") from None
        return [a.view(mx.float16 if dt == np.float16 else mx.float32).reshape(shape)
                for a, (_, shape) in zip(raw, wanted)]
    with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(wanted)))) as pool:
        futures = [pool.submit(_read_blob, pack, name, "kv", shape) for name, shape in wanted]
        try:
            return [f.result().device() for f in futures]
        finally:
            for f in futures:
                f.cancel()


def verify(path, geometry: Geometry | None = None, model_fingerprint: str | None = None) -> Pack:
    """The whole pack checked: manifest, seal, every blob's size, hash, header, dtype and shape;
    and, given a model, that it was made for that model."""
    pack = read_manifest(path)
    if geometry is not None:
        check_for_model(pack, geometry, model_fingerprint or "")
    _row_blobs(pack)
    read_last_logits(pack)
    return pack


def read_last_logits(pack: Pack) -> np.ndarray | None:
    """The logits of the pack's last position (n_vocab,) float32, checked (hash, shape, finite), or
    None when the pack holds none."""
    ll = pack.manifest.get("last_logits")
    if ll is None:
        return None
    n_vocab = pack.manifest["geometry"]["n_vocab"]
    logits = _read_blob(pack, ll["blob"], "logits", (n_vocab,), dtype=np.float32).host().copy()
    _need(bool(np.isfinite(logits).all()), pack.path, "last_logits holds values that are not finite")
    return logits


def _storage(rows: mx.array, capacity: int) -> mx.array:
    """A layer's K|V storage: `rows` (2, n_kv, held, hd) first, zeros after, as its own f16 array."""
    rows = rows.astype(KV_DTYPE)
    pad = capacity - rows.shape[2]
    if not pad:
        return mx.contiguous(rows)
    return mx.concatenate([rows, mx.zeros((*rows.shape[:2], pad, rows.shape[3]), KV_DTYPE)], axis=2)


def restore(path, geometry: Geometry, model_fingerprint: str, context: int | None = None,
            upload=None) -> tuple[SlotCache, list[int]]:
    """A new SlotCache holding the pack's rows and offset, and the token ids they are of. Every
    check, every blob's included, runs before any of the cache's storage is made; each blob's
    bytes go to MLX once they are checked, while later blobs are read and hashed (_row_arrays;
    `upload`: the ops backend's PinnedUpload, or None for mx.load), and are put in place by MLX
    ops: on a GPU the storage is made on the device. `path` may be a Pack read_manifest made."""
    pack = path if isinstance(path, Pack) else read_manifest(path)
    check_for_model(pack, geometry, model_fingerprint)
    m = pack.manifest
    context = context or m["context"]
    _need(m["offset"] <= context <= geometry.context_length, pack.path,
          f"holds {m['offset']} positions; a context of {context} cannot take them")
    _need(geometry.ring_rows(context) == geometry.ring_rows(m["context"]), pack.path,
          f"its rings were {geometry.ring_rows(m['context'])} rows; a context of {context} makes them "
          f"{geometry.ring_rows(context)}")
    arrays = _row_arrays(pack, upload)
    planes, rings = arrays[:len(m["plane_chunks"])], arrays[len(m["plane_chunks"]):]
    cache = SlotCache(geometry, context, KV_DTYPE)
    full = [i for i in range(geometry.n_layer) if not geometry.is_swa(i)]
    if planes:
        plane = planes[0] if len(planes) == 1 else mx.concatenate(planes, axis=3)
        for j, i in enumerate(full):
            layer = cache.layers[i]
            layer.restore_storage(_storage(plane[j], layer.capacity), m["offset"])
        del plane
    for grp, ring in zip(m["ring_groups"], rings):
        for j, i in enumerate(grp["layers"]):
            layer = cache.layers[i]
            layer.restore_storage(_storage(ring[j], layer.capacity), m["offset"])
    for layer in cache.layers:     # no rows held (offset 0): the storage as allocated, the offset set
        layer.offset = m["offset"]
    del arrays, planes, rings
    mx.eval(cache.state())
    return cache, list(m["tokens"])


# ---- delta and apply --------------------------------------------------------------------------


def delta(path, have: set[str], out) -> dict:
    """A pack at `out` with the full manifest and only the blobs not in `have`; returns the bytes."""
    pack = verify(path)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PackError(f"{out}: exists and is not an empty directory")
    (out / "blobs").mkdir(parents=True, exist_ok=True)
    shipped = sorted(pack.blob_names() - set(have))
    for name in shipped:
        shutil.copyfile(pack.path / "blobs" / f"{name}.safetensors", out / "blobs" / f"{name}.safetensors")
    _write_atomic(out / "manifest.json", (pack.path / "manifest.json").read_bytes())
    return {"blobs_shipped": len(shipped), "blobs_in_pack": len(pack.blob_names()),
            "bytes_shipped": sum((out / "blobs" / f"{n}.safetensors").stat().st_size for n in shipped),
            "payload_bytes_shipped": _payload_of(pack, set(shipped)), "payload_bytes_full": payload_bytes(pack.manifest)}


def _payload_of(pack: Pack, names: set[str]) -> int:
    """K/V row bytes of the blobs `names` of this pack."""
    m = pack.manifest
    g = m["geometry"]
    row = 2 * g["n_head_kv"] * g["head_dim"] * np.dtype(ENCODINGS[m["encoding"]]).itemsize
    n_full = len(_full_layers(g))
    total = sum(c["rows"] * n_full * row for c in m["plane_chunks"] if c["blob"] in names)
    return total + sum(len(r["layers"]) * m["ring_rows_held"] * row for r in m["ring_groups"] if r["blob"] in names)


def apply(delta_path, stores: list, out) -> Pack:
    """The full pack at `out`: the delta's blobs, the rest from `stores` (packs the receiver holds);
    verified before it is returned."""
    d = read_manifest(delta_path)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PackError(f"{out}: exists and is not an empty directory")
    (out / "blobs").mkdir(parents=True, exist_ok=True)
    for name in sorted(d.blob_names()):
        for src in [Path(delta_path)] + [Path(s) for s in stores]:
            f = src / "blobs" / f"{name}.safetensors"
            if f.exists():
                shutil.copyfile(f, out / "blobs" / f"{name}.safetensors")
                break
        else:
            raise PackError(f"{delta_path}: blob {name[:12]}... is in neither the delta nor the stores given")
    _write_atomic(out / "manifest.json", (Path(delta_path) / "manifest.json").read_bytes())
    return verify(out)


# ---- the command line ---------------------------------------------------------------------------


def _have(paths: list[str]) -> set[str]:
    """Blob names a receiver holds: from packs (their blobs folder) or text files of names."""
    names: set[str] = set()
    for p in map(Path, paths):
        if (p / "blobs").is_dir():
            names |= {f.name.removesuffix(".safetensors") for f in (p / "blobs").iterdir()}
        elif p.is_file():
            try:
                listed = p.read_text(encoding="utf-8").split()
            except (OSError, UnicodeDecodeError) as exc:
                raise PackError(f"{p}: not a list of blob names ({exc})") from None
            bad = [n for n in listed if not _is_name(n)]
            if bad:
                raise PackError(f"{p}: {bad[0][:20]!r} is not a blob name (64 hex digits)")
            names |= set(listed)
        else:
            raise PackError(f"{p}: neither a pack nor a file of blob names")
    return names


def _command(argv=None) -> int:
    from .cli import Parser

    p = Parser(prog="python -m muse_mlx.kvpack", description="Inspect, verify, and ship KV packs (docs/kvpack.md).")
    sub = p.add_subparsers(dest="op", required=True)
    s = sub.add_parser("inspect", help="what a pack holds (the manifest, checked for form and seal)")
    s.add_argument("pack")
    s = sub.add_parser("verify", help="check every blob; with --model, that the pack was made for it")
    s.add_argument("pack")
    s.add_argument("--model", help="the GGUF the pack must have been made for")
    s = sub.add_parser("delta", help="a pack of only the blobs a receiver lacks")
    s.add_argument("pack")
    s.add_argument("--have", action="append", default=[], required=True,
                   help="what the receiver holds: a pack, or a file of blob names (repeatable)")
    s.add_argument("-o", "--out", required=True)
    s = sub.add_parser("apply", help="complete a delta from the packs a receiver holds, and verify it")
    s.add_argument("delta")
    s.add_argument("--store", action="append", default=[], help="a pack the receiver holds (repeatable)")
    s.add_argument("-o", "--out", required=True)
    args = p.parse_args(argv)
    for name in ("out",):
        out = getattr(args, name, None)
        if out is not None and Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
            raise PackError(f"{out}: exists and is not an empty directory")
    if args.op == "inspect":
        pack = read_manifest(args.pack)
        m = pack.manifest
        g = m["geometry"]
        blobs = pack.path / "blobs"
        present = sum(1 for n in pack.blob_names() if (blobs / f"{n}.safetensors").exists())
        print(f"{pack.path}: {m['format']}, sealed {m['seal'][:19]}...")
        print(f"model {m['model']['fingerprint']} ({m['model'].get('architecture', '?')}); {g['n_layer']} layers, "
              f"window {g['sliding_window']}, {g['n_head_kv']} KV heads x {g['head_dim']}")
        print(f"{m['offset']:,} tokens of a {m['context']:,}-position slot, encoding {m['encoding']}; payload "
              f"{payload_bytes(m):,} B in {len(m['plane_chunks'])} plane chunks and {len(m['ring_groups'])} ring "
              f"groups; {present} of {len(pack.blob_names())} blobs present")
        return 0
    if args.op == "verify":
        if args.model:
            from .artifact import open_artifact

            from .tools.fixtures import cache_dir

            g = open_artifact(args.model).geometry
            pack = verify(args.pack, g, fingerprint(args.model, cache_dir()))
        else:
            pack = verify(args.pack)
        print(f"ok: {pack.path}: {pack.manifest['offset']:,} tokens, {len(pack.blob_names())} blobs verified"
              + (f", made for {args.model}" if args.model else ""))
        return 0
    if args.op == "delta":
        stats = delta(args.pack, _have(args.have), args.out)
        share = stats["payload_bytes_shipped"] / stats["payload_bytes_full"] if stats["payload_bytes_full"] else 0
        print(f"{args.out}: {stats['blobs_shipped']} of {stats['blobs_in_pack']} blobs, payload "
              f"{stats['payload_bytes_shipped']:,} of {stats['payload_bytes_full']:,} B ({share:.4%}); "
              f"{stats['bytes_shipped']:,} B on disk")
        return 0
    pack = apply(args.delta, args.store, args.out)
    print(f"ok: {pack.path}: the full pack, {len(pack.blob_names())} blobs verified")
    return 0


def main(argv=None) -> int:
    from . import cli

    return cli.run(_command, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
