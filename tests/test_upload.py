"""kernels/upload.py's pipeline (pieces into the staging's halves, checks, spans, errors) on the CPU.

The page-locked staging and the GPU's copy exist only on CUDA; here `HostUpload` keeps the staging
in ordinary memory and makes each copy with MLX from it, so everything else runs as written. The
CUDA copy kernel itself is checked on the H200 (tests/gpu/test_upload_on_gpu.py)."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx import kvpack
from muse_mlx.kernels.upload import Piece, PinnedUpload
from muse_mlx.kvpack import PackError


class _HostStaging:
    def __init__(self, nbytes: int):
        self.buffer = bytearray(nbytes)
        self.view, self.nbytes, self.device_address = memoryview(self.buffer), nbytes, 0


class HostUpload(PinnedUpload):
    """The pipeline with a host stand-in for the staging and the copy; records each copy's span."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.copies: list[tuple[int, int]] = []

    def _allocate(self, nbytes: int):
        return _HostStaging(nbytes)

    def _copy(self, at: int, nbytes: int) -> mx.array:
        self.copies.append((at, nbytes))
        return mx.array(np.frombuffer(self._staging.view[at:at + nbytes], dtype=np.uint8).copy())


@pytest.fixture()
def files(tmp_path):
    rng = np.random.default_rng(7)
    out = []
    for i, n in enumerate([1, 15, 16, 17, 4096, 5000, 9999, 3, 12345, 777]):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        out.append(p)
    return out


def test_pieces_come_back_in_order_through_both_halves(files):
    """Pieces of several sizes at several offsets, a half of 16 KiB so that both halves are filled
    and refilled: each array is the file's bytes of its piece."""
    up = HostUpload(half_bytes=16384, threads=3)
    pieces = [Piece(f, off, f.stat().st_size - off) for f in files for off in (0, min(2, f.stat().st_size - 1))]
    got = up.upload(pieces)
    for p, a in zip(pieces, got):
        assert a.dtype == mx.uint8 and bytes(np.array(a)) == p.path.read_bytes()[p.offset:p.offset + p.size]
    halves = {at // up.half_bytes for at, _ in up.copies}
    assert halves == {0, 1} and len(up.copies) == len(pieces)


def test_a_check_sees_the_bytes_and_picks_the_span(files):
    seen = {}

    def check(i, view):
        assert view.readonly
        seen[i] = hashlib.sha256(view).hexdigest()
        return 3, len(view) - 5

    up = HostUpload(half_bytes=16384, threads=2)
    pieces = [Piece(f, 0, f.stat().st_size) for f in files if f.stat().st_size >= 8]
    got = up.upload(pieces, check)
    for i, (p, a) in enumerate(zip(pieces, got)):
        data = p.path.read_bytes()
        assert seen[i] == hashlib.sha256(data).hexdigest() and bytes(np.array(a)) == data[3:-2]


def test_a_refusal_or_a_short_file_is_raised(files, tmp_path):
    up = HostUpload(half_bytes=16384, threads=2)
    pieces = [Piece(f, 0, f.stat().st_size) for f in files]

    def refuse_the_fifth(i, view):
        if i == 5:
            raise PackError("piece 5 refused")
        return 0, len(view)
    with pytest.raises(PackError, match="piece 5 refused"):
        up.upload(pieces, refuse_the_fifth)
    with pytest.raises(OSError, match="ends at byte"):
        up.upload([Piece(files[4], 100, files[4].stat().st_size)])
    with pytest.raises(ValueError, match="larger than the staging's half"):
        HostUpload(half_bytes=8192).upload([Piece(files[8], 0, 12345)])
    with pytest.raises(ValueError, match="span"):
        up.upload([Piece(files[4], 0, 4096)], lambda i, v: (10, 4096))
    assert [bytes(np.array(a)) for a in up.upload(pieces[:2])] == [f.read_bytes() for f in files[:2]]


@pytest.fixture(scope="module")
def model(f32_fixture):
    from muse_mlx.model import load
    return load(f32_fixture)


@pytest.mark.parametrize("encoding", ["f16", "f32"])
def test_a_restore_through_the_upload_is_the_same_cache(model, f32_fixture, tmp_path, encoding):
    """Across a ring wrap, with blobs several to a half: the same rows and offsets, byte for byte,
    as kvpack's mx.load path; a tampered blob is refused on this path too."""
    g = model.geometry
    ids = [int(t) for t in np.random.default_rng(3).integers(0, g.n_vocab, 2 * g.sliding_window + 9)]
    cache = model.make_cache(4 * g.sliding_window)
    model.prefill(ids, cache)
    fp = "sha256:" + "1" * 64
    pack = kvpack.save(cache, ids, {"fingerprint": fp}, tmp_path / "p", encoding=encoding, chunk_rows=16)
    up = HostUpload(half_bytes=256 * 1024, threads=2)
    a, _ = kvpack.restore(pack, g, fp, upload=up)
    assert len(up.copies) == len(list((pack / "blobs").iterdir()))
    b, _ = kvpack.restore(pack, g, fp)
    assert a.offset == b.offset == len(ids)
    for la, lb in zip(a.layers, b.layers):
        for x, y in zip(la.held_rows(), lb.held_rows()):
            assert np.array(x).tobytes() == np.array(y).tobytes()
    blob = sorted((pack / "blobs").iterdir())[-1]
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(PackError, match="does not hash to its name"):
        kvpack.restore(pack, g, fp, upload=up)


def test_a_half_is_refilled_only_after_its_copies_were_waited_for(files, monkeypatch):
    """The staging's protocol: a piece is read into bytes that no copy still in flight reads from.
    The stand-in's copies count as in flight until the pipeline waits for them (mx.eval; an
    async_eval is not a wait), and every read asserts it overlaps none of them."""
    in_flight: dict[int, tuple[int, int]] = {}
    real_eval = mx.eval

    def waiting(*arrays):
        flat = [a for x in arrays for a in (x if isinstance(x, (list, tuple)) else [x])]
        for a in flat:
            in_flight.pop(id(a), None)
        return real_eval(*arrays)

    class Watched(HostUpload):
        def _copy(self, at, nbytes):
            a = super()._copy(at, nbytes)
            in_flight[id(a)] = (at, at + nbytes)
            return a

        def _read_checked(self, piece, index, at, check):
            for lo, hi in list(in_flight.values()):
                assert hi <= at or at + piece.size <= lo, "a read overwrote bytes a copy was still reading"
            return super()._read_checked(piece, index, at, check)

    monkeypatch.setattr(mx, "eval", waiting)
    up = Watched(half_bytes=12000, threads=3)
    pieces = [Piece(f, 0, f.stat().st_size) for f in files if f.stat().st_size <= 12000] * 4
    got = up.upload(pieces)
    assert [bytes(np.array(a)) for a in got] == [p.path.read_bytes() for p in pieces]
    assert not in_flight   # every copy waited for before upload returned


def test_the_cuda_driver_loads_by_its_soname_without_find_library(monkeypatch):
    """kernels/device.load_cuda_driver: the soname first (ctypes.util.find_library runs ldconfig in
    a subprocess); find_library only when the soname does not load, and one clear OSError when
    neither does."""
    import ctypes
    import ctypes.util

    from muse_mlx.kernels import device

    opened = []

    def fake_cdll(name, *a, **k):
        if name not in loadable:
            raise OSError(f"{name}: cannot open shared object file")
        opened.append(name)
        return name

    monkeypatch.setattr(ctypes, "CDLL", fake_cdll)
    loadable = {"libcuda.so.1"}
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: pytest.fail("find_library"))
    assert device.load_cuda_driver() == "libcuda.so.1"
    loadable = {"/opt/driver/libcuda.so"}
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "/opt/driver/libcuda.so")
    assert device.load_cuda_driver() == "/opt/driver/libcuda.so"
    loadable = set()
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    with pytest.raises(OSError, match="libcuda.so.1"):
        device.load_cuda_driver()
