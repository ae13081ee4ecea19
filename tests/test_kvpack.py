"""kvpack (docs/kvpack.md): save and restore bit for bit, prefixes that share blobs, delta = full,
and every refusal of a pack that is not what it claims."""

from __future__ import annotations

import hashlib
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx import kvpack
from muse_mlx.kvpack import PackError
from muse_mlx.model import load
from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, write_fixture

W = DEFAULT_GEOMETRY.sliding_window


@pytest.fixture(scope="module")
def model(f32_fixture):
    return load(f32_fixture)


@pytest.fixture(scope="module")
def model_id(f32_fixture, tmp_path_factory):
    return {"fingerprint": kvpack.fingerprint(f32_fixture, tmp_path_factory.mktemp("fp")), "architecture": "muse-glimmer"}


def prompt(n, seed=1):
    return [int(t) for t in np.random.default_rng(seed).integers(0, DEFAULT_GEOMETRY.n_vocab, n)]


def rows_of(cache):
    return [np.array(a) for layer in cache.layers for a in layer.held_rows()] + [cache.offset]


def continue_logits(model, cache, tokens):
    return np.stack([np.array(model.step(t, cache)) for t in tokens])


@pytest.mark.parametrize("encoding", ["f16", "f32"])
@pytest.mark.parametrize("n", [0, 5, 2 * W + 7])
def test_restore_is_bit_for_bit_and_decodes_the_same(model, model_id, tmp_path, encoding, n):
    """Across the ring wrap (2W + 7 positions: every ring rotated), and at 0 and 5 positions;
    the restored cache's rows and offsets equal the original's byte for byte, and decoding on
    from each gives the same logits, bit for bit."""
    ids = prompt(n)
    cache = model.make_cache(4 * W)
    if ids:
        model.prefill(ids, cache)
    pack = kvpack.save(cache, ids, model_id, tmp_path / "p", encoding=encoding, chunk_rows=32)
    restored, tokens = kvpack.restore(pack, model.geometry, model_id["fingerprint"])
    assert tokens == ids and restored.offset == cache.offset and restored.context == cache.context
    for a, b in zip(rows_of(cache), rows_of(restored)):
        assert np.array_equal(a, b) if isinstance(a, int) else a.tobytes() == b.tobytes()
    nxt = prompt(W + 3, seed=9)
    assert np.array_equal(continue_logits(model, cache, nxt), continue_logits(model, restored, nxt))


def test_a_common_prefix_shares_blobs_and_a_delta_ships_the_rest(model, model_id, tmp_path):
    """B continues A's cache: B's pack holds A's whole plane chunks byte for byte; the delta of B
    against A ships the rest (and the rings), and applying it gives B's pack exactly."""
    ids_a, more = prompt(100), prompt(90, seed=2)
    cache = model.make_cache(4 * W)
    model.prefill(ids_a, cache)
    a = kvpack.read_manifest(kvpack.save(cache, ids_a, model_id, tmp_path / "a", chunk_rows=32))
    model.prefill(more, cache)
    b = kvpack.read_manifest(kvpack.save(cache, ids_a + more, model_id, tmp_path / "b", chunk_rows=32))
    shared = a.blob_names() & b.blob_names()
    assert len(shared) == 100 // 32   # A's three whole chunks (its fourth, 4 rows, is not B's)
    stats = kvpack.delta(b.path, a.blob_names(), tmp_path / "d")
    assert stats["blobs_shipped"] == len(b.blob_names() - shared)
    g = model.geometry
    row = 2 * g.n_head_kv * g.head_dim * 2
    assert stats["payload_bytes_full"] == (g.n_full * 190 + g.n_swa * W) * row
    assert stats["payload_bytes_shipped"] == (g.n_full * (190 - 96) + g.n_swa * W) * row
    with pytest.raises(PackError, match="missing"):
        kvpack.verify(tmp_path / "d")   # a delta alone is not a pack
    full = kvpack.apply(tmp_path / "d", [a.path], tmp_path / "full")
    for name in b.blob_names():
        assert (full.path / "blobs" / f"{name}.safetensors").read_bytes() == \
            (b.path / "blobs" / f"{name}.safetensors").read_bytes()
    restored, _ = kvpack.restore(full.path, g, model_id["fingerprint"])
    for x, y in zip(rows_of(cache), rows_of(restored)):
        assert np.array_equal(x, y)


def test_the_handoff_holds_back_the_boundary_token(model, model_id, tmp_path):
    """The sender packs all but the last token; the receiver decodes that token itself and gets
    the sender's logits for it, bit for bit."""
    ids = prompt(W + 20)
    sender = model.make_cache(2 * W)
    model.prefill(ids[:-1], sender)
    pack = kvpack.save(sender, ids[:-1], model_id, tmp_path / "h")
    receiver, held = kvpack.restore(pack, model.geometry, model_id["fingerprint"])
    want = np.array(model.step(ids[-1], sender))
    got = np.array(model.step(ids[-1], receiver))
    assert held == ids[:-1] and np.array_equal(want, got)


# ---- refusals -----------------------------------------------------------------------------


@pytest.fixture
def pack(model, model_id, tmp_path):
    ids = prompt(W + 11)
    cache = model.make_cache(2 * W)
    model.prefill(ids, cache)
    return kvpack.save(cache, ids, model_id, tmp_path / "p", chunk_rows=32)


def rewrite(path, change):
    """Change the manifest with `change(m)` and reseal it (a tamperer who knows the format)."""
    m = json.loads((path / "manifest.json").read_text())
    change(m)
    m["seal"] = kvpack.seal_of(m)
    (path / "manifest.json").write_text(json.dumps(m))


def refused(pack_path, model, model_id, fragment):
    with pytest.raises(PackError, match=fragment) as exc:
        kvpack.restore(pack_path, model.geometry, model_id["fingerprint"])
    assert "\n" not in str(exc.value)


def test_another_model_is_refused(pack, model, tmp_path, model_id):
    refused(pack, model, {"fingerprint": "sha256:" + "0" * 64}, "made for model")


def test_another_geometry_is_refused(pack, model, model_id, tmp_path):
    other = write_fixture(tmp_path / "other.gguf", geometry=DEFAULT_GEOMETRY.with_(sliding_window=W // 2), seed=7)
    g = load(other).geometry
    with pytest.raises(PackError, match="another geometry .*sliding_window"):
        kvpack.restore(pack, g, model_id["fingerprint"])


def test_a_changed_manifest_breaks_the_seal(pack, model, model_id):
    m = (pack / "manifest.json").read_text().replace('"offset":75', '"offset":74')
    (pack / "manifest.json").write_text(m)
    refused(pack, model, model_id, "seal")


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_a_tampered_blob_is_refused(pack, model, model_id, how):
    blob = sorted((pack / "blobs").iterdir())[0]
    data = bytearray(blob.read_bytes())
    if how == "flip":
        data[-3] ^= 0x40
        blob.write_bytes(bytes(data))
    elif how == "truncate":
        blob.write_bytes(bytes(data[:len(data) // 2]))
    else:
        blob.unlink()
    refused(pack, model, model_id, {"flip": "does not hash to its name", "truncate": "its tensor needs .* \\(changed or cut\\)",
                                    "delete": "missing"}[how])


@pytest.mark.parametrize("change, fragment", [
    (lambda m: m.update(tokens=m["tokens"][:-1]), "token list"),
    (lambda m: m.update(tokens=m["tokens"][:-1] + [10**9]), "token id"),
    (lambda m: m.update(offset=2**40), "offset"),
    (lambda m: m.update(context=2**40), "context"),
    (lambda m: m.update(ring_rows_held=2**40), "ring_rows_held"),
    (lambda m: m.update(chunk_rows=0), "chunk_rows"),
    (lambda m: m["plane_chunks"].pop(), "cover"),
    (lambda m: m["plane_chunks"].reverse(), "out of order"),
    (lambda m: m["ring_groups"].pop(), "ring groups"),
    (lambda m: m.update(encoding="int8"), "encoding"),
    (lambda m: m.update(format="muse-kvpack/9"), "format"),
    (lambda m: m["geometry"].update(n_layer=-3), "geometry"),
    (lambda m: m["plane_chunks"][0].update(blob="../../etc/passwd"), "malformed"),
])
def test_a_resealed_lie_is_refused_before_allocating(pack, model, model_id, change, fragment, monkeypatch):
    rewrite(pack, change)
    from muse_mlx import kv

    monkeypatch.setattr(kv.SlotCache, "__init__", lambda *a, **k: pytest.fail("allocated before refusing"))
    refused(pack, model, model_id, fragment)


def test_a_huge_manifest_is_refused_unread(pack, model, model_id):
    with open(pack / "manifest.json", "ab") as f:
        f.truncate(kvpack.MANIFEST_MAX_BYTES + 1)
    refused(pack, model, model_id, "more than")


def test_a_manifest_nested_past_the_parser_s_stack_is_refused(pack, model, model_id):
    (pack / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(pack, model, model_id, "not JSON")


def _blob_bytes(header: dict, data: bytes, pad: int = 0) -> bytes:
    """A safetensors file written by hand (the library refuses to write most of these)."""
    text = json.dumps(header).encode() + b" " * pad
    return len(text).to_bytes(8, "little") + text + data


_KV = "kv"


def _hostile(shape, data: bytes) -> dict[str, bytes]:
    """Blobs of about the right size whose headers lie, each in one way."""
    n = len(data)
    ok = {"dtype": "F16", "shape": list(shape), "data_offsets": [0, n]}
    return {
        "header length past the file": (2**40).to_bytes(8, "little") + b"{}" + data,
        "header not JSON": _blob_bytes({}, data)[:8] + b"\xff" * 2 + data,
        "header a list": _blob_bytes([ok], data),                       # type: ignore[arg-type]
        "unknown dtype": _blob_bytes({_KV: ok | {"dtype": "I8"}}, data),
        "negative dimension": _blob_bytes({_KV: ok | {"shape": [-1] + list(shape[1:])}}, data),
        "offsets past the data": _blob_bytes({_KV: ok | {"data_offsets": [2, n + 2]}}, data),
        "offsets that do not fit the shape": _blob_bytes({_KV: ok | {"data_offsets": [2, n]}}, data),
        "two tensors": _blob_bytes({_KV: ok | {"shape": [1] + list(shape[1:]), "data_offsets": [0, n // shape[0]]},
                                    "rest": {"dtype": "F16", "shape": [shape[0] - 1] + list(shape[1:]),
                                             "data_offsets": [n // shape[0], n]}}, data),
        "another name": _blob_bytes({"k.0": ok}, data),
        "another shape": _blob_bytes({_KV: ok | {"shape": [shape[0] * shape[1]] + list(shape[2:])}}, data),
        "F32 in an f16 pack": _blob_bytes({_KV: ok | {"dtype": "F32", "shape": list(shape[:-1]) + [shape[-1] // 2]}},
                                          data),
    }


@pytest.mark.parametrize("lie", list(_hostile((2, 2, 1, 4, 8), bytes(256))))
def test_a_blob_whose_header_lies_is_refused_before_any_storage(pack, model, model_id, lie, monkeypatch):
    """A blob that hashes to its name (a tamperer who rewrote the manifest and resealed it) but
    whose safetensors header is hostile: refused in one line, before MLX loads anything."""
    m = json.loads((pack / "manifest.json").read_text())
    old = m["plane_chunks"][0]["blob"]
    data = (pack / "blobs" / f"{old}.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    shape = tuple(json.loads(data[8:8 + n])["kv"]["shape"])
    hostile = _hostile(shape, data[8 + n:])[lie]
    new = hashlib.sha256(hostile).hexdigest()
    (pack / "blobs" / f"{new}.safetensors").write_bytes(hostile)
    rewrite(pack, lambda m: m["plane_chunks"][0].update(blob=new))
    loads = []
    monkeypatch.setattr(kvpack.mx, "load", lambda *a, **k: loads.append(a))
    with pytest.raises(PackError, match=r"blob .* (is not a safetensors file|holds|tensor kv is)") as exc:
        kvpack.restore(pack, model.geometry, model_id["fingerprint"])
    assert "\n" not in str(exc.value) and not loads


def test_an_f32_pack_of_values_f16_cannot_hold_is_refused(model, model_id, tmp_path):
    ids = prompt(9)
    cache = model.make_cache(2 * W)
    model.prefill(ids, cache)
    path = kvpack.save(cache, ids, model_id, tmp_path / "f32", encoding="f32")
    m = json.loads((path / "manifest.json").read_text())
    from safetensors.numpy import load as st_load, save as st_save

    old = m["ring_groups"][0]["blob"]
    t = st_load((path / "blobs" / f"{old}.safetensors").read_bytes())
    key = sorted(t)[0]
    t[key] = t[key].copy()
    t[key].flat[0] += np.float32(1e-6)   # not an f16 value
    data = st_save(t)
    new = hashlib.sha256(data).hexdigest()
    (path / "blobs" / f"{new}.safetensors").write_bytes(data)
    rewrite(path, lambda m: m["ring_groups"][0].update(blob=new))
    refused(path, model, model_id, "f16 cannot represent")


def test_fuzzed_packs_are_refused_or_restore_exactly(pack, model, model_id, tmp_path):
    """Seeded byte mutations of the manifest and of blobs: each restore is refused with PackError,
    or (a mutation that changed nothing the pack depends on) restores the original rows."""
    original, _ = kvpack.restore(pack, model.geometry, model_id["fingerprint"])
    want = rows_of(original)
    rng = np.random.default_rng(23)
    files = [pack / "manifest.json"] + sorted((pack / "blobs").iterdir())
    outcomes = {"refused": 0, "same": 0}
    for i in range(60):
        work = tmp_path / f"m{i}"
        shutil.copytree(pack, work)
        f = work / files[i % len(files)].relative_to(pack)
        data = bytearray(f.read_bytes())
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        f.write_bytes(bytes(data))
        try:
            got, _ = kvpack.restore(work, model.geometry, model_id["fingerprint"])
        except PackError as exc:
            assert "\n" not in str(exc)
            outcomes["refused"] += 1
            continue
        assert all(np.array_equal(a, b) for a, b in zip(want, rows_of(got)))
        outcomes["same"] += 1
    assert outcomes["refused"] >= 50, outcomes


def _pieces_digest(data: bytes, piece: int) -> str:
    """The fingerprint's definition, computed here from the bytes alone (the test's oracle)."""
    parts = [data[i:i + piece] for i in range(0, len(data), piece)] or [b""]
    return hashlib.sha256(len(data).to_bytes(8, "little") + b"".join(hashlib.sha256(p).digest()
                                                                    for p in parts)).hexdigest()


@pytest.mark.parametrize("piece, threads", [(1000, 1), (1000, 3), (4096, 8), (kvpack.FINGERPRINT_PIECE, 2)])
def test_the_file_digest_is_its_definition(f32_fixture, tmp_path, piece, threads):
    """Pieces hashed on threads, joined in order, whatever the thread count; a file that is an
    exact number of pieces, one that is not, and an empty file."""
    data = f32_fixture.read_bytes()
    exact = tmp_path / "exact.bin"
    exact.write_bytes(data[:3 * piece] if len(data) >= 3 * piece else data)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    for f in (f32_fixture, exact, empty):
        assert kvpack.file_digest(f, piece, threads) == _pieces_digest(f.read_bytes(), piece), f.name


def test_the_fingerprint_is_the_file_and_is_cached(f32_fixture, tmp_path):
    cache_dir = tmp_path / "fp"
    fp = kvpack.fingerprint(f32_fixture, cache_dir)
    assert fp == "sha256/64MiB:" + _pieces_digest(f32_fixture.read_bytes(), 64 * 2**20)
    assert json.loads((cache_dir / "fingerprints.json").read_text())
    changed = tmp_path / "changed.gguf"
    data = bytearray(f32_fixture.read_bytes())
    data[-1] ^= 1
    changed.write_bytes(bytes(data))
    assert kvpack.fingerprint(changed, cache_dir) != fp


# ---- the prompt cache: warm = cold, bit for bit ----------------------------------------------


def cold_tokens(model, ids, sampler_settings, n, chunk):
    from muse_mlx.generate import decode_tokens
    from muse_mlx.sampling import Sampler

    cache = model.make_cache(4 * W + 64)
    logits = model.prefill(ids, cache, chunk)
    return list(decode_tokens(model, cache, logits[-1], Sampler(sampler_settings), n)), logits


@pytest.mark.parametrize("settings", [{}, {"temp": 0.9, "top_k": 50, "seed": 4}], ids=["greedy", "seeded"])
def test_warm_prompt_cache_output_is_the_cold_output(model, model_id, tmp_path, settings):
    """Checkpoints every 64 positions (chunks of 32): a second prompt that shares the first's first
    150 tokens restores the checkpoint at 128 and prefills the rest; its logits and tokens equal a
    cold run's, bit for bit, greedy and seeded."""
    from muse_mlx.generate import decode_tokens
    from muse_mlx.prompt_cache import PromptCache
    from muse_mlx.sampling import Sampler, SamplerSettings

    s = SamplerSettings(**settings)
    warned = []
    pc = PromptCache(tmp_path / "pc", model_id, model.geometry, every=64, chunk=32, warn=warned.append)
    first, second = prompt(170, seed=3), prompt(150, seed=3) + prompt(60, seed=8)
    reused = []
    for ids in (first, second, first):
        hit = pc.lookup(ids, 4 * W + 64)
        reused.append(hit.reused)
        if hit.logits is not None:      # the prompt's exact end: its last logits, no prefill
            cache, logits = hit.cache, mx.array(hit.logits).reshape(1, -1)
        else:
            cache = hit.cache or model.make_cache(4 * W + 64)
            logits = pc.prefill(model, ids, cache, hit.reused)
        warm = list(decode_tokens(model, cache, logits[-1], Sampler(s), 12))
        cold, cold_logits = cold_tokens(model, ids, s, 12, chunk=32)
        assert np.array_equal(np.array(logits[-1]), np.array(cold_logits[-1])) and warm == cold
    # the first prompt's checkpoints: 64, 128, 160 and its end (170, with logits; not a prefix of
    # the second, which shares 150); the first again: its end
    assert reused == [0, 128, 170] and not warned


def test_a_pack_keeps_its_last_logits_checked(model, model_id, tmp_path):
    """last_logits: float32 whatever the encoding, in the seal and the blob list, hash-checked;
    non-finite ones are refused when saving."""
    ids = prompt(40, seed=21)
    cache = model.make_cache(128)
    logits = np.array(model.prefill(ids, cache))[-1]
    for enc in ("f16", "f32"):
        out = kvpack.save(cache, ids, model_id, tmp_path / enc, encoding=enc, last_logits=logits)
        pack = kvpack.verify(out, model.geometry, model_id["fingerprint"])
        m = pack.manifest
        assert np.array_equal(kvpack.read_last_logits(pack), logits)
        assert len(pack.blob_names()) == len(m["plane_chunks"]) + len(m["ring_groups"]) + 1
    assert kvpack.read_last_logits(kvpack.read_manifest(kvpack.save(cache, ids, model_id, tmp_path / "none"))) is None
    blob = tmp_path / "f16" / "blobs" / f"{kvpack.read_manifest(tmp_path / 'f16').manifest['last_logits']['blob']}.safetensors"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(kvpack.PackError, match="does not hash"):
        kvpack.read_last_logits(kvpack.read_manifest(tmp_path / "f16"))
    bad = logits.copy()
    bad[3] = np.nan
    with pytest.raises(kvpack.PackError, match="finite"):
        kvpack.save(cache, ids, model_id, tmp_path / "nan", last_logits=bad)


def test_a_corrupt_prompt_cache_entry_is_dropped_with_a_warning(model, model_id, tmp_path):
    from muse_mlx.prompt_cache import PromptCache

    warned = []
    pc = PromptCache(tmp_path / "pc", model_id, model.geometry, every=64, chunk=32, warn=warned.append)
    ids = prompt(100, seed=5)
    pc.prefill(model, ids, model.make_cache(256), 0)
    for blob in (tmp_path / "pc" / "blobs").iterdir():   # one byte of every blob, through its links
        data = bytearray(blob.read_bytes())
        data[-1] ^= 1
        with open(blob, "r+b") as f:
            f.write(bytes(data))
    cache, reused, _, logits = pc.lookup(ids, 256)   # the end (100, with logits), then 96 and 64
    assert cache is None and reused == 0 and logits is None and len(warned) == 3 and "corrupt" in warned[0]
    assert not any((tmp_path / "pc" / "entries").iterdir())


def test_a_store_the_disk_refuses_is_warned_about_and_the_prompt_goes_on(model, model_id, tmp_path, monkeypatch):
    """A full disk (ENOSPC from every write after the first checkpoint's): each checkpoint that cannot be
    written is warned about and removed whole, the prompt's logits are a cold run's all the same,
    and only entries written in full remain (a lookup finds the deepest). A prompt cache folder that
    becomes unreadable is warned about and the prompt computed."""
    import errno

    from muse_mlx.prompt_cache import PromptCache
    from muse_mlx.sampling import SamplerSettings

    warned = []
    pc = PromptCache(tmp_path / "pc", model_id, model.geometry, every=64, chunk=32, warn=warned.append)
    ids = prompt(170, seed=6)
    writes, real = [], kvpack._write_atomic

    def full_disk(path, data):   # the disk fills once the first checkpoint (64) is written
        if any(p.name == "manifest.json" for p in writes):
            raise OSError(errno.ENOSPC, "No space left on device")
        writes.append(path)
        return real(path, data)
    monkeypatch.setattr(kvpack, "_write_atomic", full_disk)
    logits = pc.prefill(model, ids, model.make_cache(4 * W + 64), 0)
    _, cold_logits = cold_tokens(model, ids, SamplerSettings(), 1, chunk=32)
    assert np.array_equal(np.array(logits[-1]), np.array(cold_logits[-1]))
    assert warned and all("No space left on device" in w and "going on without it" in w for w in warned)
    entries = list((tmp_path / "pc" / "entries").iterdir())
    assert all((e / "manifest.json").exists() for e in entries)   # nothing half-written is left
    monkeypatch.setattr(kvpack, "_write_atomic", real)
    assert len(entries) == 1 and len(warned) == 3   # 64 stored; 128, 160 and the end (170) refused
    assert pc.lookup(ids, 4 * W + 64).reused == 64
    warned.clear()

    def unreadable(path):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(kvpack, "read_manifest", unreadable)
    hit = pc.lookup(ids, 4 * W + 64)
    assert hit.cache is None and hit.reused == 0 and len(warned) == 1 and "cannot read" in warned[0]
    assert all((e / "manifest.json").exists() for e in entries)   # not taken for corrupt: nothing removed


def test_the_prompt_cache_keeps_to_its_budget_least_recently_used_first(model, model_id, tmp_path):
    from muse_mlx.prompt_cache import PromptCache

    pc = PromptCache(tmp_path / "pc", model_id, model.geometry, every=64, chunk=32)
    a, b = prompt(70, seed=11), prompt(70, seed=12)
    pc.prefill(model, a, model.make_cache(256), 0)
    one = pc.bytes_held()
    pc.budget = int(one * 1.5)          # room for one prompt's entries, not two
    pc.prefill(model, b, model.make_cache(256), 0)
    assert pc.bytes_held() <= pc.budget
    assert pc.lookup(a + [1], 256)[1] == 0 and pc.lookup(b + [1], 256)[1] == 64
    assert all(f.stat().st_nlink > 1 for f in (tmp_path / "pc" / "blobs").iterdir())   # no orphans


def test_a_lookup_reads_only_the_prompts_own_entries(model, model_id, tmp_path, monkeypatch):
    """Entries are found by the ids of the prompt's prefixes: with other prompts' entries stored,
    a lookup reads the manifests of this prompt's entries only, the deepest first, and stops at
    the first it restores."""
    from muse_mlx.prompt_cache import PromptCache

    pc = PromptCache(tmp_path / "pc", model_id, model.geometry, every=64, chunk=32)
    for seed in (31, 32, 33):
        pc.prefill(model, prompt(140, seed=seed), model.make_cache(256), 0)
    read = []
    real = kvpack.read_manifest
    monkeypatch.setattr(kvpack, "read_manifest", lambda path: read.append(path.name) or real(path))
    ids = prompt(140, seed=32)[:130] + prompt(20, seed=40)
    hit = pc.lookup(ids, 256)
    assert hit.reused == 128 and hit.logits is None
    assert read == [pc._entry_id(ids[:128])]
    read.clear()
    assert pc.lookup(prompt(140, seed=32), 256).reused == 140 and len(read) == 1


# ---- the command lines ------------------------------------------------------------------------


def test_generate_save_and_load_kv_reproduce_the_cold_run(f32_fixture, tmp_path):
    from test_generate import run_cli

    text = " ".join(f"w{i}" for i in range(400))          # ~1,500 tokens: a checkpoint at 1,024
    cold = run_cli("--model", str(f32_fixture), "-p", text, "-m", "10")
    saved = run_cli("--model", str(f32_fixture), "-p", text, "-m", "10", "--save-kv", str(tmp_path / "kv"))
    loaded = run_cli("--model", str(f32_fixture), "-p", text, "-m", "10", "--load-kv", str(tmp_path / "kv"))
    assert cold.returncode == saved.returncode == loaded.returncode == 0, loaded.stderr
    assert cold.stdout == saved.stdout == loaded.stdout
    import re

    restored, n_prompt = map(int, re.search(r"kv: restored (\d+) of (\d+)", loaded.stderr).groups())
    assert restored == (n_prompt - 1) // 512 * 512 > 0
    warm = [run_cli("--model", str(f32_fixture), "-p", text, "-m", "10", "--prompt-cache", str(tmp_path / "pc"))
            for _ in range(2)]
    assert [w.stdout for w in warm] == [cold.stdout] * 2
    assert "reused 0 of" in warm[0].stderr
    assert f"reused {n_prompt} of {n_prompt}" in warm[1].stderr and "nothing to prefill" in warm[1].stderr
    longer = text + " w400 w401"   # extends the prompt: the checkpoint on a chunk multiple, not the end
    warm_longer = run_cli("--model", str(f32_fixture), "-p", longer, "-m", "10", "--prompt-cache", str(tmp_path / "pc"))
    assert warm_longer.stdout == run_cli("--model", str(f32_fixture), "-p", longer, "-m", "10").stdout
    assert f"reused {restored} of" in warm_longer.stderr
    bad = run_cli("--model", str(f32_fixture), "-p", "something else", "--load-kv", str(tmp_path / "kv"))
    assert bad.returncode == 2 and "not a proper prefix" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_kvpack_cli(model, model_id, f32_fixture, tmp_path):
    import subprocess
    import sys

    def kvp(*args):
        return subprocess.run([sys.executable, "-m", "muse_mlx.kvpack", *map(str, args)], capture_output=True,
                              text=True, timeout=300)

    ids = prompt(2 * W + 3)
    cache = model.make_cache(4 * W)
    model.prefill(ids[:W], cache)
    a = kvpack.save(cache, ids[:W], model_id, tmp_path / "a", chunk_rows=32)
    model.prefill(ids[W:], cache)
    b = kvpack.save(cache, ids, model_id, tmp_path / "b", chunk_rows=32)
    r = kvp("inspect", b)
    assert r.returncode == 0 and f"{len(ids):,} tokens" in r.stdout
    r = kvp("verify", b, "--model", f32_fixture)
    assert r.returncode == 0 and r.stdout.startswith("ok:"), r.stderr
    r = kvp("delta", b, "--have", a, "-o", tmp_path / "d")
    assert r.returncode == 0 and "4 of 6 blobs" in r.stdout, r.stdout + r.stderr   # 5 chunks + 1 ring group, 2 shared
    r = kvp("apply", tmp_path / "d", "--store", a, "-o", tmp_path / "full")
    assert r.returncode == 0 and r.stdout.startswith("ok:"), r.stderr
    other = write_fixture(tmp_path / "o.gguf", seed=99)
    for args, fragment in [(("verify", b, "--model", other), "made for model"),
                           (("verify", tmp_path / "nothing"), "not a pack"),
                           (("apply", tmp_path / "d", "-o", tmp_path / "x"), "neither the delta nor"),
                           (("delta", b, "--have", tmp_path / "nothing", "-o", tmp_path / "y"), "neither a pack"),
                           (("frobnicate",), "invalid choice")]:
        r = kvp(*args)
        assert r.returncode == 2 and fragment in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_prompt_cache_that_is_not_a_folder_is_one_line(f32_fixture, tmp_path):
    from test_generate import run_cli

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    r = run_cli("--model", str(f32_fixture), "-m", "2", "--prompt-cache", str(not_a_dir / "pc"))
    assert r.returncode == 2 and "cannot use it as a folder" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    r = run_cli("--model", str(f32_fixture), "-m", "2", "--prompt-cache")   # the default folder
    assert r.returncode == 0 and "prompt cache: reused 0 of" in r.stderr, r.stderr
