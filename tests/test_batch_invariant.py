"""KernelConfig.batch_invariant: a sequence's numbers do not depend on the rest of its batch.

The kernels run as their Metal text in the emulator (tests/metal_emulator.py), planned for a
CUDA device, so the routes are CUDA's: one row streams and two or more take the tensor-core form
(through the Metal dialect's stand-in for mma.m16n8k16) by default, and under batch_invariant
every row count takes the tensor-core form. Each check is bitwise: a row computed in a batch of
B against the same row computed alone. Each also runs the default configuration and requires a
difference there, so that the check can tell (on the GPU, tests/gpu/test_kernels.py runs the
whole step with MLX's own kernels).
"""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from muse_mlx.artifact import open_artifact
from muse_mlx.config import KernelConfig
from muse_mlx.kernels import Device, Kernels, plan
from muse_mlx.model import Model
from muse_mlx.ops.gpu import DecodeStep, DevicePositions, GpuOps, decode_plan
from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, kquant_mix, random_blocks, write_random_blocks
from metal_emulator import CXX, EmulatedKernel

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler for the Metal emulator")

H200_LIKE = Device("cuda", 4, 232448, (9, 0))   # the H200's threadgroup memory, 4 multiprocessors
EXACT = KernelConfig(stream_groups=2, batch_invariant=1)
# The default's routes, with the tensor cores taken at these small matrices as the default takes
# them from 1,024 rows (mma_pair_min_rows, mma_min_rows; smaller ones keep x_shared, whose rows are
# summed in one row's order).
DEFAULT = KernelConfig(stream_groups=2, mma_pair_min_rows=0, mma_min_rows=0)


def cuda_emulated(config: KernelConfig) -> Kernels:
    """Kernels planned for a CUDA device whose launches run the Metal text in the emulator."""
    return Kernels(H200_LIKE, config, build=lambda name, which, shared: EmulatedKernel(name))


def rows_of_x(rng, b: int, k: int) -> np.ndarray:
    """b rows of x at magnitudes 2^-8 .. 2^8 apart: a scale shared between rows would show."""
    return (rng.standard_normal((b, k)) * np.exp2(rng.integers(-8, 9, (b, 1)))).astype(np.float32)


def alone_and_together(kernels: Kernels, w: np.ndarray, qtype: QT, x: np.ndarray, batches) -> list[bool]:
    """For each B of `batches`: whether every row of x[:B] computed together equals it alone."""
    alone = [np.array(kernels.matvec(mx.array(w), qtype, mx.array(x[b:b + 1]))) for b in range(len(x))]
    out = []
    for B in batches:
        together = np.array(kernels.matvec(mx.array(w), qtype, mx.array(x[:B])))
        out.append(all(np.array_equal(together[b:b + 1], alone[b]) for b in range(B)))
    return out


@pytest.mark.parametrize("qtype, n, k, config", [
    (QT.Q4_K, 37, 768, {}),                                   # rows past a whole tile
    (QT.Q6_K, 40, 1280, {}),                                  # Q6_K blocks off 4-byte boundaries
    (QT.Q4_K, 33, 2048, {"mma_warps": 6, "mma_tile_warps": 2}),   # warps split between tiles
    (QT.Q6_K, 21, 2048, {"mma_parts": 4}),                    # K in four parts, added in order
], ids=["q4k", "q6k", "q4k-tile-warps", "q6k-parts"])
def test_products_do_not_depend_on_the_batch(qtype, n, k, config):
    """A row's product is the same bits alone (B = 1) and among 2, 3, 4 rows, and among 6 (two
    launches); by default one row streams and several take the tensor cores, which differs."""
    from dataclasses import replace
    rng = np.random.default_rng([n, k, int(qtype), 51])
    w, x = random_blocks(n, k, qtype, rng), rows_of_x(rng, 6, k)
    exact = cuda_emulated(replace(EXACT, **config))
    if config.get("mma_parts"):
        assert plan.mma_plan(qtype, k, n, 1, exact.device, exact.config).parts == config["mma_parts"]
    assert alone_and_together(exact, w, qtype, x, (2, 3, 4, 6)) == [True] * 4
    assert not all(alone_and_together(cuda_emulated(replace(DEFAULT, **config)), w, qtype, x, (2, 3)))


def test_products_without_the_tensor_cores_do_not_depend_on_the_batch():
    """Where the tensor-core form is not taken (Metal's plans), the streaming pair (one row with x
    in registers, several with x_shared, each output summed in one row's order) is invariant as it
    stands, and batch_invariant keeps it. Where several rows cannot stream (stream_batch = 1: no
    x_shared), the default streams one row and sends several to matvec.inc, which differs;
    batch_invariant sends every row count to matvec.inc."""
    from dataclasses import replace
    from metal_emulator import emulated_kernels
    rng = np.random.default_rng(52)
    n, k = 24, 512
    w, x = random_blocks(n, k, QT.Q4_K, rng), rows_of_x(rng, 4, k)

    def run(config):
        names = []
        kernels = emulated_kernels(config)
        build = kernels._build
        kernels._build = lambda name, which, shared: (names.append(name), build(name, which, shared))[1]
        return alone_and_together(kernels, w, QT.Q4_K, x, (2, 4)), set(names)
    assert run(EXACT) == ([True, True], {"matvec_stream_q4_k", "matvec_stream_shared_q4_k"})
    assert run(replace(EXACT, stream_batch=1)) == ([True, True], {"matvec_q4_k"})
    unshared, names = run(replace(EXACT, stream_batch=1, batch_invariant=0))
    assert names == {"matvec_stream_q4_k", "matvec_q4_k"} and not all(unshared)


def attention_rows(kernels: Kernels, depths: list[int], capacity: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Sequence 0's gated decode attention over a plane of `depths[0]` rows: alone, planned from
    its own rows (as a step of one sequence plans it), and in one launch with the others, planned
    from all of theirs (DecodePlan: the deepest sequence's rows per split, the most splits any
    needs)."""
    g = DEFAULT_GEOMETRY
    cfg = kernels.config
    S = len(depths)
    q = mx.array(rng.standard_normal((S, g.n_head, g.head_dim)).astype(np.float32))
    gate = mx.array(rng.standard_normal((S, g.n_head * g.head_dim)).astype(np.float32))
    kvs = [mx.array(rng.standard_normal((2, g.n_head_kv, capacity, g.head_dim)).astype(np.float16))
           for _ in range(S)]

    def plan_for(valid):
        chunk = plan.plane_chunk(max(valid), cfg)
        return chunk, max(plan.attention_splits(v, chunk, capacity) for v in valid)
    chunk, splits = plan_for(depths[:1])
    alone = kernels.decode_attention(q[:1], kvs[0], plan.attention_params(depths[0], chunk, splits), chunk, splits,
                                     gate=gate[:1], out_shape=(1, g.n_head * g.head_dim))
    chunk, splits = plan_for(depths)
    params = mx.concatenate([plan.attention_params(d, chunk, splits).reshape(1, 8) for d in depths])
    together = kernels.decode_attention_seqs(q, kvs, params, chunk, splits, gate=gate)
    return np.array(alone)[0], np.array(together)[0]


def test_decode_attention_does_not_depend_on_the_batch():
    """A shallow sequence (100 rows) beside a deep one (1,100), with 64-row plane splits halved
    down to 16 while a plane would take fewer than 16 (the defaults' rule at a quarter of their
    sizes): by default its batch gives it 64-row splits where alone it takes 16-row ones, and more
    splits; under batch_invariant its splits and their order of summation are its own, so its
    output is the same bits."""
    depths, capacity = [100, 1100, 40, 500], 1152
    sizes = dict(ring_chunk=16, plane_chunk=64, plane_splits_min=16)
    exact = cuda_emulated(KernelConfig(stream_groups=2, batch_invariant=1, **sizes))
    alone, together = attention_rows(exact, depths, capacity, np.random.default_rng(53))
    assert np.isfinite(alone).all() and np.array_equal(alone, together)
    default = cuda_emulated(KernelConfig(stream_groups=2, **sizes))
    assert plan.plane_chunk(100, default.config) != plan.plane_chunk(1100, default.config)
    alone, together = attention_rows(default, depths, capacity, np.random.default_rng(53))
    assert not np.array_equal(alone, together)


def test_combine_order_does_not_follow_the_split_count():
    """With the rows per split the same (16, plane_splits_min = 0), the default's combine still
    takes one simdgroup per 16 splits: 10 splits alone (4 simdgroups) against 90 in a batch (6)
    sum sequence 0's splits in other groups. batch_invariant fixes the simdgroups."""
    depths, capacity = [150, 1430], 1440
    rng = 54
    sizes = dict(ring_chunk=16, plane_chunk=16, plane_splits_min=0)
    exact = cuda_emulated(KernelConfig(stream_groups=2, batch_invariant=1, **sizes))
    alone, together = attention_rows(exact, depths, capacity, np.random.default_rng(rng))
    assert np.array_equal(alone, together)
    default = cuda_emulated(KernelConfig(stream_groups=2, **sizes))
    assert plan.combine_warps(10, default.config) != plan.combine_warps(90, default.config)
    alone, together = attention_rows(default, depths, capacity, np.random.default_rng(rng))
    assert not np.array_equal(alone, together)


def test_decode_step_does_not_depend_on_the_batch(tmp_path):
    """The whole decode step (products, glue kernels, K|V writes, attention, LM head) of a small
    random Q4_K_M model (a sliding layer of Q4_K, a full one with Q6_K's V and FFN down, a Q6_K
    LM head), planned for CUDA: four sequences at depths 3 .. 700 (one past its ring's wrap)
    decoded in one step, and the shallowest and the deepest each alone in a step of one. Under
    batch_invariant their logits are the same bits; by default neither's are. The step is the compiled step's
    function run eagerly (the emulator's kernels read their inputs on the host, which a trace
    cannot give them)."""
    g = DEFAULT_GEOMETRY.with_(n_layer=2, n_ff=256, n_vocab=272, swa_layers=(True, False))
    path = write_random_blocks(tmp_path / "q4km.gguf", g, kquant_mix(g), seed=7)
    depths, tokens = [3, 70, 700, 9], [5, 17, 200, 255]
    small = dict(stream_groups=2, mma_warps=4, combine_warps=4)   # fewer emulated threads

    def logits(config: KernelConfig) -> tuple[list[np.ndarray], np.ndarray]:
        ops = GpuOps(cuda_emulated(config))
        model = Model(open_artifact(path), ops)
        caches = []
        for i, d in enumerate(depths):
            caches.append(model.make_cache(768))
            caches[-1].fill_random(d, seed=i)

        def step(rows):
            kv_plan = decode_plan([caches[r] for r in rows], ops.kernels, DevicePositions(), model._rope)
            kv = DecodeStep(kv_plan.key, kv_plan.positions, kv_plan.arrays, ops.kernels)
            return np.array(model.forward(mx.array([[tokens[r]] for r in rows]), kv.rope, kv, mx.float16))[:, 0]
        return [step([r])[0] for r in alone_rows], step(list(range(len(depths))))

    alone_rows = (0, 2)   # the shallowest and the deepest, each alone (the emulator's mma is slow)
    alone, together = logits(KernelConfig(batch_invariant=1, **small))
    assert all(np.isfinite(a).all() for a in alone) and np.isfinite(together).all()
    assert all(np.array_equal(a, together[r]) for r, a in zip(alone_rows, alone))
    alone, together = logits(KernelConfig(mma_pair_min_rows=0, mma_min_rows=0, **small))
    assert not any(np.array_equal(a, together[r]) for r, a in zip(alone_rows, alone))
