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
