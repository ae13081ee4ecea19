"""weight_stream: raw tensors read by MLX's loader from the GGUF file, byte for byte."""

import io

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load as st_load

from muse_mlx.artifact import RawTensor, open_artifact
from muse_mlx.weight_stream import TensorStream, load_raw


@pytest.fixture(scope="module")
def artifact(fixture_dir):
    from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, kquant_mix, write_random_blocks

    return open_artifact(write_random_blocks(fixture_dir / "stream-q4km.gguf", DEFAULT_GEOMETRY,
                                             kquant_mix(DEFAULT_GEOMETRY), seed=3))


def test_the_stream_is_a_safetensors_file_of_the_tensors(artifact):
    """Read whole, the stream is a safetensors file (read by the safetensors library, the oracle)
    whose tensors are the file's bytes of each tensor, in the order given."""
    raws = list(artifact.tensors.values())[5:17]
    stream = TensorStream(artifact.path, raws)
    got = st_load(stream.read())
    assert set(got) == {str(i) for i in range(len(raws))}
    for i, r in enumerate(raws):
        assert got[str(i)].dtype == np.uint8 and np.array_equal(got[str(i)], r.data), r.name


def test_reads_at_any_place_and_length_give_the_same_bytes(artifact):
    raws = list(artifact.tensors.values())[:9]
    whole = TensorStream(artifact.path, raws).read()
    stream = TensorStream(artifact.path, raws)
    rng = np.random.default_rng(5)
    for _ in range(300):
        at, n = int(rng.integers(0, len(whole) + 10)), int(rng.integers(0, 5000))
        stream.seek(at)
        buf = bytearray(n)
        got = stream.readinto(buf)
        assert bytes(buf[:got]) == whole[at:at + n] and stream.tell() == min(at + n, max(at, len(whole)))
    stream.seek(-3, io.SEEK_END)
    assert stream.read() == whole[-3:]
    stream.close()


def test_load_raw_gives_each_tensor_as_stored(artifact):
    """Every tensor of the file through mx.load, and a tensor made in memory (no file) copied."""
    raws = list(artifact.tensors.values())
    made = RawTensor("made", raws[0].qtype, raws[0].shape, np.arange(raws[0].nbytes, dtype=np.uint8).reshape(
        raws[0].data.shape))
    arrays = load_raw(raws + [made])
    mx.eval(arrays)
    for r, a in zip(raws + [made], arrays):
        assert a.dtype == mx.uint8 and np.array_equal(np.array(a), r.data), r.name


@pytest.mark.parametrize("piece_bytes", [1, 1000, 4096, 10**9])
def test_tensors_read_in_pieces_are_put_together_exactly(artifact, piece_bytes):
    """Row ranges of at most piece_bytes (one row when a row is longer), concatenated: the same
    bytes, for pieces smaller than a row, not dividing the rows, and larger than the tensor."""
    raws = [t for n, t in artifact.tensors.items() if n.startswith("blk.0.") or n == "token_embd.weight"]
    arrays = load_raw(raws, piece_bytes)
    mx.eval(arrays)
    for r, a in zip(raws, arrays):
        assert a.shape == r.data.shape and np.array_equal(np.array(a), r.data), r.name


def test_the_gpu_ops_read_in_pieces_only_on_cuda():
    from muse_mlx.config import KernelConfig
    from muse_mlx.kernels import Kernels
    from muse_mlx.kernels.device import Device
    from muse_mlx.ops.gpu import GpuOps
    from muse_mlx.ops.reference import ReferenceOps

    assert ReferenceOps().raw_piece_bytes is None
    for backend, want in (("cuda", 16 * 2**20), ("metal", None)):
        dev = Device(backend=backend, cores=8)
        assert GpuOps(Kernels(dev, KernelConfig())).raw_piece_bytes == want


def test_a_file_cut_after_it_was_opened_is_one_clear_error(tmp_path):
    """The tensors are read from the file when loaded: a file truncated since open_artifact checked
    it gives one ArtifactError naming it, not MLX's exception."""
    from muse_mlx.errors import ArtifactError
    from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, kquant_mix, write_random_blocks

    path = write_random_blocks(tmp_path / "cut.gguf", DEFAULT_GEOMETRY, kquant_mix(DEFAULT_GEOMETRY), seed=4)
    a = open_artifact(path)
    raws = [a.tensors["output.weight"]]
    with open(path, "r+b") as f:
        f.truncate(raws[0].offset + raws[0].nbytes // 2)
    with pytest.raises(ArtifactError, match="cannot read its tensors any more") as exc:
        load_raw(raws)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_the_device_flag_agrees_with_the_host_scan(fixture_dir):
    """weight_stream.nonfinite_flag (MLX ops over the loaded bytes) against the artifact's host scan
    (numpy over the mapping, the oracle), per matrix, on each type the scan knows: clean tensors,
    then each with one element or block scale set to NaN, Inf, or (F32/BF16) 1e5."""
    from gguf import GGMLQuantizationType as QT

    from muse_mlx.artifact import NONFINITE_MASK, F16_SCALES, _first_nonfinite
    from muse_mlx.weight_stream import nonfinite_flag

    rng = np.random.default_rng(17)
    for qtype in [*NONFINITE_MASK, *F16_SCALES, QT.NVFP4]:
        from muse_mlx.tools.fixtures import random_blocks

        k = 512
        data = random_blocks(6, k, qtype, rng) if qtype not in NONFINITE_MASK else \
            rng.standard_normal((6, k)).astype({QT.F32: np.float32, QT.F16: np.float16}.get(qtype, np.float32))
        if qtype == QT.BF16:
            data = (rng.standard_normal((6, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(6, -1)
        cases = [raw]
        for value in (np.nan, np.inf, 1e5):
            bad = raw.copy()
            r, c = int(rng.integers(0, 6)), int(rng.integers(0, k))
            if qtype in NONFINITE_MASK:
                width = {QT.F32: 4, QT.F16: 2, QT.BF16: 2}[qtype]
                v = np.array([-np.inf if value == 1e5 and qtype == QT.F16 else value], np.float32)
                b = v.astype(np.float16).view(np.uint8) if qtype == QT.F16 else \
                    (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8) if qtype == QT.BF16 else v.view(np.uint8)
                bad[r, c * width:(c + 1) * width] = b
            elif qtype in F16_SCALES:
                from gguf import GGML_QUANT_SIZES

                off, count = F16_SCALES[qtype]
                size = GGML_QUANT_SIZES[qtype][1]
                blk = c % (bad.shape[1] // size)
                which = int(rng.integers(0, count))
                bad[r, blk * size + off + 2 * which:blk * size + off + 2 * which + 2] = \
                    np.array([-np.inf if value == 1e5 else value], np.float16).view(np.uint8)
            cases.append(bad)
        for case in cases:
            t = RawTensor("m", qtype, (k, 6), case)
            host = _first_nonfinite(t) is not None
            flag = nonfinite_flag(t, mx.array(case))
            assert (False if flag is None else bool(flag.item())) == host, (qtype.name, host)


def test_load_checks_the_matrices_without_the_host_scan(f32_fixture, monkeypatch):
    """model.load opens the file without the host weight scan: a good file loads with the scan
    unreachable (the matrices are checked on the loaded bytes)."""
    import muse_mlx.artifact as artifact
    import muse_mlx.model as model

    monkeypatch.setattr(artifact, "check_matrix_weights", lambda *a, **k: pytest.fail("host scan"))
    monkeypatch.setattr(model, "check_matrix_weights", lambda *a, **k: pytest.fail("host scan"))
    model.load(f32_fixture)


@pytest.mark.parametrize("half_bytes", [4096, 50_000, 2**27])
def test_upload_raw_gives_each_tensor_as_stored(artifact, half_bytes):
    """The weights through the staging (KernelConfig.weights_staged; the staging a host stand-in,
    tests/test_upload.py): each tensor in row ranges of at most a half, put together, equal to the
    file's bytes (the oracle: the mapped file), with a tensor made in memory copied."""
    from test_upload import HostUpload

    from muse_mlx.weight_stream import upload_raw

    raws = [t for n, t in artifact.tensors.items() if n.startswith("blk.1.") or n == "output.weight"]
    made = RawTensor("made", raws[0].qtype, raws[0].shape, np.arange(raws[0].nbytes, dtype=np.uint8).reshape(
        raws[0].data.shape))
    up = HostUpload(half_bytes=half_bytes, threads=2)
    arrays = upload_raw(raws + [made], up)
    mx.eval(arrays)
    for r, a in zip(raws + [made], arrays):
        assert a.shape == r.data.shape and np.array_equal(np.array(a), r.data), r.name
    assert len(up.copies) >= len(raws)


@pytest.mark.parametrize("staged", [0, 1])
def test_the_gpu_ops_load_the_weights_ahead_in_one_pass_when_staged(artifact, monkeypatch, staged):
    """KernelConfig.weights_staged = 1 (CUDA; the staging a host stand-in): begin_weights reads every
    matrix through the staging in one pass, and the matrices the model then asks for come from it,
    byte for byte the file's, with mx.load never called; 0 leaves the weights to mx.load."""
    from test_upload import HostUpload

    import muse_mlx.ops.reference as reference
    from muse_mlx.config import KernelConfig
    from muse_mlx.kernels import Kernels
    from muse_mlx.kernels.device import Device
    from muse_mlx.ops.gpu import GpuOps

    up = HostUpload(half_bytes=2**20, threads=2)
    monkeypatch.setattr(GpuOps, "upload", property(lambda self: up))
    ops = GpuOps(Kernels(Device(backend="cuda", cores=8), KernelConfig(weights_staged=staged)))
    raws = list(artifact.tensors.values())
    ops.begin_weights(raws)
    matrices = [r for r in raws if len(r.shape) == 2]
    assert bool(up.copies) == bool(staged)
    if staged:
        monkeypatch.setattr(reference, "load_raw", lambda *a, **k: pytest.fail("mx.load"))
    for r in matrices:
        (a,) = ops.load_raw([r])
        assert a.shape == r.data.shape and np.array_equal(np.array(a), r.data), r.name
    assert not ops._ahead


@pytest.mark.parametrize("staged", [0, 1])
def test_a_non_finite_matrix_is_refused_staged_or_not(f32_fixture, tmp_path, monkeypatch, staged):
    """A NaN in one matrix of a file opened without the host scan: the model's load refuses it and
    names the tensor, whether the weights came through the staging in one pass (their flags read
    once, after the last layer) or a layer at a time (the staging a host stand-in)."""
    import shutil

    from test_upload import HostUpload

    from muse_mlx.artifact import open_artifact
    from muse_mlx.config import KernelConfig
    from muse_mlx.errors import ArtifactError
    from muse_mlx.kernels import Kernels
    from muse_mlx.kernels.device import Device
    from muse_mlx.model import Model
    from muse_mlx.ops.gpu import GpuOps

    path = tmp_path / "nan.gguf"
    shutil.copy(f32_fixture, path)
    target = open_artifact(path, check_weights=False).tensors["blk.5.ffn_up.weight"]
    with open(path, "r+b") as f:
        f.seek(target.offset + 4 * 300)
        f.write(np.array([np.nan], dtype=np.float32).tobytes())
    up = HostUpload(half_bytes=2**20, threads=2)
    monkeypatch.setattr(GpuOps, "upload", property(lambda self: up))
    ops = GpuOps(Kernels(Device(backend="cuda", cores=8), KernelConfig(weights_staged=staged)))
    with pytest.raises(ArtifactError, match="blk.5.ffn_up.weight"):
        Model(open_artifact(path, check_weights=False), ops)
    assert bool(up.copies) == bool(staged)
