"""The kernel sources and launch plans without a GPU: one body per kernel for both backends, the
plans within what the hardware allows, the configuration's checks, and the backend choice.

The kernels themselves run in tests/gpu (on the H200) and, as Metal text, in the emulator
(test_metal_kernels_emulated.py).
"""

import mlx.core as mx
import pytest
from gguf import GGMLQuantizationType as QT

from muse_mlx.config import KernelConfig
from muse_mlx.errors import MuseError
from muse_mlx.kernels import Device, gpu_backend, plan
from muse_mlx.kernels.source import KERNELS, compact, header_items, prune, read, render, sections, strip_comments
from muse_mlx.model import load
from muse_mlx.ops import select_ops

H200 = Device("cuda", 132)
METAL = Device("metal", 64)


@pytest.mark.parametrize("name", list(KERNELS))
def test_metal_and_cuda_share_the_body(name):
    family, parts, _, _ = KERNELS[name]
    body = compact(strip_comments("".join(sections(family)[p] for p in parts)))
    for which in ("metal", "cuda"):
        header, source = render(family, parts, which)
        assert source.endswith(body)
        assert source[: -len(body)].strip() == compact(strip_comments(read(f"indices_{which}.h"))).strip()
        full = compact(strip_comments(read(f"dialect_{which}.h") + "\n" + read("blocks.h"))).splitlines()
        lines = header.splitlines()   # the pruned header: the full one's lines, in order, some left out
        it = iter(full)
        assert all(any(line == f for f in it) for line in lines)


def test_prune_keeps_what_the_source_uses_directly_or_through_what_it_keeps():
    header = "\n".join([
        "#define ONE(x) (x + 1)",
        "#define TWO(x) ONE(ONE(x))",
        "#define UNUSED 3",
        "#pragma once",
        "template <typename P> inline float scaled(P p) {",
        "  return TWO(p[0]);",
        "}",
        "__device__ __forceinline__ float lonely(float v)",
        "{",
        "  if (v > 0) { return v; }",
        "  return -v;",
        "}",
        "template <int N>",
        "__device__ void waits() { asm volatile(\"wait %0;\" :: \"n\"(N)); }",
        "inline float helper(float v) { return v; }",
        "inline float caller(float v) { return helper(v) * 2.0f; }",
        "",
    ])
    kept = prune(header, "y[0] = scaled(x) + caller(1.0f);")
    assert [name for name, _ in header_items(kept) if name] == ["ONE", "TWO", "scaled", "helper", "caller"]
    assert "#pragma once" in kept and "lonely" not in kept and "UNUSED" not in kept
    assert "return -v" not in kept   # the multi-line function left out whole
    # a template line standing alone goes with its function (left alone, it would bind to `helper`)
    assert "template" not in kept.replace("template <typename P> inline float scaled", "")
    assert [name for name, _ in header_items(header) if name] == [
        "ONE", "TWO", "UNUSED", "scaled", "lonely", "waits", "helper", "caller"]


@pytest.mark.parametrize("name", list(KERNELS))
def test_metal_source_names_its_thread_attributes(name):
    """MLX adds a Metal attribute only when its name is in the source text (DESIGN.md §4)."""
    family, parts, _, _ = KERNELS[name]
    _, source = render(family, parts, "metal")
    body = "".join(sections(family)[p] for p in parts)
    uses = {"LANE": "thread_index_in_simdgroup", "WARP": "simdgroup_index_in_threadgroup",
            "GROUP_X": "threadgroup_position_in_grid", "GROUP_Y": "threadgroup_position_in_grid",
            "THREAD_X": "thread_position_in_threadgroup", "NUM_GROUPS_X": "threadgroups_per_grid"}
    for macro, attribute in uses.items():
        if macro in body:
            assert attribute in source
    assert "uint " not in body  # NVRTC has no `uint`; the bodies use uint32_t


def test_every_section_is_used():
    """No kernel text outlives the kernels that use it (a variant that lost leaves the tree)."""
    used = {(family, p) for family, parts, _, _ in KERNELS.values() for p in parts}
    for family in {f for f, _, _, _ in KERNELS.values()}:
        for name in sections(family):
            assert (family, name) in used, (family, name)


def test_no_gpu_on_cpu_means_reference_backend(f32_fixture):
    assert gpu_backend() is None  # CI has neither Metal nor CUDA
    model = load(f32_fixture)
    assert model.ops.name == "reference" and model.path.startswith("MLX ops")
    assert all(not m.raw for m in model.matrices())
    with pytest.raises(MuseError, match="Metal or CUDA"):
        select_ops("gpu")
    with pytest.raises(MuseError, match="backend must be one of"):
        select_ops("tpu")


def test_stream_threads_hold_one_unit_each():
    """One 64-value unit of K per thread at the pinned shapes (the x values stay in registers)."""
    assert [plan.stream_threads(k) for k in (4096, 6656, 19968)] == [64, 128, 320]
    assert plan.stream_threads(256) == 32          # the fixtures: 4 units, one simdgroup
    assert plan.stream_threads(32768) == 512
    assert plan.stream_threads(33024) is None      # 516 units: matvec.inc takes it


@pytest.mark.parametrize("device", [H200, Device("cuda", 78), METAL], ids=["h200", "sm78", "metal"])
def test_stream_plans_fit_the_hardware(device):
    """Every streaming-matvec plan at the pinned shapes (and the widest K): at most 2,048 threads
    of a multiprocessor's resident groups, R a multiple of RF, no more groups than row groups."""
    shapes = [(QT.Q4_K, 6656, 8448), (QT.Q4_K, 4096, 6656), (QT.Q4_K, 6656, 39936), (QT.Q4_K, 19968, 6656),
              (QT.Q6_K, 19968, 6656), (QT.Q6_K, 6656, 256), (QT.Q6_K, 6656, 202048), (QT.Q4_K, 32768, 9),
              (QT.Q6_K, 32768, 9), (QT.Q4_K, 256, 37)]
    for qtype, K, N in shapes:
        p = plan.stream_plan(qtype, K, N, device, KernelConfig())
        tpg = plan.stream_threads(K)
        assert p.rows % p.rows_loaded == 0 and 1 <= p.groups <= -(-N // p.rows)
        if device.backend == "cuda":
            per_sm = -(-min(p.groups, device.cores * max(1, 2048 // tpg)) // device.cores)
            assert per_sm * tpg <= 2048
            assert p.groups <= device.cores * max(1, plan.STREAM_MAX_THREADS // tpg)


@pytest.mark.parametrize("device", [H200, Device("cuda", 78), METAL], ids=["h200", "sm78", "metal"])
def test_small_matrices_get_a_row_group_per_core(device):
    """A streaming matvec over few rows (V: 256) does not leave multiprocessors idle while each
    group walks its rows in turn: rows per group shrink (to 2 at least) until there are as many
    row groups as cores, or the rows run out; large matrices keep the variant's R."""
    for qtype in (QT.Q4_K, QT.Q6_K):
        R0, RF0 = plan.STREAM_VARIANTS[qtype][1:]
        for N in (1, 37, 256, 4096, 39936):
            p = plan.stream_plan(qtype, 6656, N, device, KernelConfig())
            assert p.rows % p.rows_loaded == 0 and p.rows_loaded <= RF0
            if -(-N // R0) >= device.cores:
                assert p.rows == R0
            else:
                assert p.rows < R0 and (p.rows == 2 or -(-N // p.rows) >= device.cores)


def test_stream_groups_come_from_the_device_or_the_config():
    """Threadgroups: the device's multiprocessors x the groups that fit one by registers; a
    configured count is taken as given."""
    assert plan.stream_groups(128, H200, KernelConfig()) == 132 * 4
    assert plan.stream_groups(128, Device("cuda", 78), KernelConfig()) == 78 * 4
    assert plan.stream_groups(320, H200, KernelConfig()) == 132
    assert plan.stream_groups(128, H200, KernelConfig(stream_groups=300)) == 300
    assert plan.stream_groups(128, METAL, KernelConfig()) == 64


def test_rows_of_x_per_streaming_launch_fit_threadgroup_memory():
    """A packed step's rows of x go to the streaming kernel's threadgroup memory, 64 floats a row
    and thread: on the H200 (227 KB a threadgroup) four rows at K = 4,096 and 6,656, two at
    19,968 (the FFN down projection); on Apple GPUs (32 KB) three up to K = 2,048 (32 threads),
    none from 2,049 on (matvec.inc then); stream_batch bounds it, and 0 or 1 turns it off."""
    h200 = Device("cuda", 132, 232448)
    assert [plan.stream_batch_rows(k, h200, KernelConfig()) for k in (4096, 6656, 19968)] == [4, 4, 2]
    assert [plan.stream_batch_rows(k, METAL, KernelConfig()) for k in (256, 2048, 3584, 4096, 6656)] == [3, 3, 0, 0, 0]
    assert plan.stream_batch_rows(4096, h200, KernelConfig(stream_batch=2)) == 2
    assert plan.stream_batch_rows(4096, h200, KernelConfig(stream_batch=1)) == 0
    for k in (4096, 6656, 19968):
        b = plan.stream_batch_rows(k, h200, KernelConfig())
        _, memory, launch = plan.stream_launch(QT.Q4_K, k, 6656, "", 0, h200, KernelConfig(), b, k)
        assert memory == 4 * 64 * b * plan.stream_threads(k) and memory + plan.STREAM_RED_BYTES <= h200.group_memory
        assert launch["output_shapes"] == [(b, 6656)]
        p = plan.stream_plan(QT.Q4_K, k, 6656, h200, KernelConfig(), b)
        per_sm = -(-p.groups // h200.cores)
        assert per_sm * (memory + plan.STREAM_RED_BYTES) <= h200.group_memory + plan.STREAM_RED_BYTES * per_sm
        assert per_sm * plan.stream_threads(k) <= 2048


def test_batched_stream_rows_per_pass():
    """stream_batch_rf: the rows of weights decoded per pass over the B rows of x, the plan's by
    default, capped at the rows per step (Q6_K at B = 4 steps 4 rows), never at B = 1; and lowered
    where a threadgroup's registers would pass the multiprocessor's (which fails the launch)."""
    h200 = Device("cuda", 132, 232448)
    default = plan.stream_plan(QT.Q4_K, 6656, 8704, h200, KernelConfig(), 2)
    assert default.rows_loaded == plan.STREAM_BATCH_RF
    for rf in (1, 2, 4):
        config = KernelConfig(stream_batch_rf=rf)
        assert plan.stream_plan(QT.Q4_K, 6656, 8704, h200, config, 2).rows_loaded == rf
        assert plan.stream_plan(QT.Q6_K, 6656, 8704, h200, config, 4).rows_loaded == min(rf, 4)
        assert plan.stream_plan(QT.Q4_K, 6656, 8704, h200, config, 1) == plan.stream_plan(
            QT.Q4_K, 6656, 8704, h200, KernelConfig(), 1)
        name, _, launch = plan.stream_launch(QT.Q4_K, 6656, 8704, "", 0, h200, config, 3, 6656)
        assert name == "matvec_stream_shared_q4_k" and ("RF", rf) in launch["template"]
    # 416 threads (K = 26,624): Q6_K's 168 registers at RF = 2 would ask 69,888 of 65,536
    assert plan.stream_batch_rows(26624, h200, KernelConfig()) == 2
    rf2 = KernelConfig(stream_batch_rf=2)
    assert plan.stream_plan(QT.Q6_K, 26624, 6656, h200, rf2, 2).rows_loaded == 1
    assert plan.stream_plan(QT.Q4_K, 26624, 6656, h200, rf2, 2).rows_loaded == 2
    assert plan.stream_plan(QT.Q4_K, 26624, 6656, h200, KernelConfig(stream_batch_rf=4), 2).rows_loaded == 2
    for (qtype, b, rf), regs in plan.STREAM_BATCH_REGISTERS.items():   # every planned launch fits
        for k in range(256, 32769, 256):
            rows = plan.stream_batch_rows(k, h200, KernelConfig())
            if b <= rows:
                p = plan.stream_plan(qtype, k, 6656, h200, KernelConfig(stream_batch_rf=rf), b)
                used = plan.STREAM_BATCH_REGISTERS[qtype, b, p.rows_loaded]
                assert used * plan.stream_threads(k) <= plan.GROUP_REGISTERS, (qtype, b, rf, k)


def test_parts_of_k_reach_the_residual_step():
    """At two to four rows o_proj (8 parts of K) and FFN down (6) reach residual_norm as their parts,
    which it adds (its FP), with no node of their own between; one row streams, with no parts."""
    from muse_mlx.kernels import Kernels
    from muse_mlx.ops.gpu import GpuOps
    from muse_mlx.ops.reference import Matrix, Slice
    h200 = Device("cuda", 132, 232448)

    def residual_fp(config, rows, which):
        seen = {}

        def build(name, backend, memory):
            def launch(*, inputs, output_shapes, output_dtypes, template=(), **kw):
                seen[name] = dict(template)
                return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
            return launch
        ops = GpuOps(Kernels(h200, config, build=build))
        n = 6656
        if which == "o_proj":
            k = 4096
            w = Matrix(mx.zeros((n, k // 256 * 144), dtype=mx.uint8), QT.Q4_K, True, k, n)
            f = ops.project_out(w, mx.ones((rows, k)))
        else:
            k = 19968
            w = Matrix(mx.zeros((n, k // 256 * 210), dtype=mx.uint8), QT.Q6_K, True, k, n)
            gu = mx.ones((rows, 2 * k))
            f = ops.down_silu(w, Slice(gu, 0, k), Slice(gu, k, k))
        ones = mx.ones((n,))
        mx.eval(ops.residual_norm(mx.ones((rows, n)), f, ones, ones, 1e-8, 1e-6))
        return seen["residual_norm"]["FP"], seen["residual_norm"]["R"]
    assert residual_fp(KernelConfig(), 4, "o_proj") == (8, 4) and residual_fp(KernelConfig(), 2, "o_proj") == (8, 2)
    assert residual_fp(KernelConfig(), 3, "down") == (6, 3)
    assert residual_fp(KernelConfig(), 1, "o_proj") == (1, 0) == residual_fp(KernelConfig(), 1, "down")


def test_tensor_core_plans_fit_the_hardware():
    """The tensor-core form (2..4 rows of x on CUDA): at the pinned shapes x's fragments for all
    of K fit one part up to K = 6,656, the FFN down product's 19,968 takes two parts; threadgroup
    memory, threads and registers fit a multiprocessor (the fewest parts that fit: mma_parts = 0).
    The whole threadgroup on one tile splits K's whole blocks with the fewest idle warps within
    the registers (Q4_K 96 a thread: 21 warps; Q6_K 80: 25): 16 / 26 / 39 blocks over 16 / 13 / 13
    warps for both. With the default mma_parts (6),
    19,968 takes six parts of 52 units, 4,096 eight of 8 (no count from 6 up splits 6,656's 26
    blocks into whole blocks, so it keeps one). Metal's plans keep x_shared, and so does
    stream_mma=0 on CUDA."""
    from muse_mlx.kernels import Kernels
    h200 = Device("cuda", 132, 232448)
    whole = KernelConfig(mma_tile_warps=32, mma_parts=0)     # the whole threadgroup on one tile
    for k, parts in ((19968, 6), (4096, 8), (6656, 1)):
        assert plan.mma_plan(QT.Q4_K, k, 6656, 4, h200, KernelConfig()).parts == parts
    for qtype, expect in ((QT.Q4_K, ((4096, 16, 1), (6656, 13, 1), (19968, 13, 2))),
                          (QT.Q6_K, ((4096, 16, 1), (6656, 13, 1), (19968, 13, 2)))):
        for k, warps, parts in expect:
            for b in (2, 3, 4):
                p = plan.mma_plan(qtype, k, 6656, b, h200, whole)
                assert p.tile_warps == p.warps
                assert (p.warps, p.parts) == (warps, parts), (qtype, k, b, p)
                assert p.memory == plan.MMA_UNIT_BYTES[qtype] * k // 64 // parts + 32
                per_sm = -(-p.groups * p.parts // h200.cores)
                assert per_sm * (p.memory + plan.MMA_WARP_BYTES * p.warps) <= h200.group_memory
                assert per_sm <= plan.groups_by_registers(plan.MMA_REGISTERS[qtype], 32 * p.warps)
                name, memory, launch = plan.mma_launch(qtype, k, 6656, h200, whole, b, 2 * k)
                assert name == f"matvec_mma_{qtype.name.lower()}" and memory == p.memory
                assert ("XS", 2 * k) in launch["template"]
                assert launch["output_shapes"] == [(b, 6656) if parts == 1 else (parts, b, 6656)]
                assert launch["grid"][1] == parts
    assert plan.mma_plan(QT.Q5_K, 6656, 6656, 2, h200, KernelConfig()) is None
    assert plan.mma_plan(QT.Q4_K, 6656, 6656, 5, h200, KernelConfig()) is None
    assert Kernels(h200, KernelConfig(mma_pair_min_rows=0))._takes_mma(QT.Q4_K, 6656, 6656, 2)  # from 2 rows on
    # the default at two rows (1,024): every matrix but V's 256 rows
    assert Kernels(h200)._takes_mma(QT.Q4_K, 6656, 39936, 2) and Kernels(h200)._takes_mma(QT.Q4_K, 6656, 8704, 2)
    assert not Kernels(h200)._takes_mma(QT.Q6_K, 6656, 256, 2)
    assert not Kernels(h200, KernelConfig(stream_mma=3))._takes_mma(QT.Q4_K, 6656, 6656, 2)
    assert Kernels(h200)._takes_mma(QT.Q4_K, 6656, 6656, 3) and Kernels(h200)._takes_mma(QT.Q6_K, 19968, 6656, 4)
    assert Kernels(h200, KernelConfig(stream_mma=2, mma_pair_min_rows=0))._takes_mma(QT.Q4_K, 6656, 6656, 2)
    assert not Kernels(h200, KernelConfig(stream_mma=0))._takes_mma(QT.Q4_K, 6656, 6656, 4)
    # two rows over matrices below mma_pair_min_rows keep x_shared; three rows take the tensor cores
    pair = Kernels(h200, KernelConfig(mma_pair_min_rows=16384))
    assert not pair._takes_mma(QT.Q4_K, 6656, 8704, 2) and not pair._takes_mma(QT.Q6_K, 19968, 6656, 2)
    assert pair._takes_mma(QT.Q4_K, 6656, 39936, 2) and pair._takes_mma(QT.Q4_K, 6656, 16384, 2)
    assert pair._takes_mma(QT.Q4_K, 6656, 8704, 3) and pair._takes_mma(QT.Q6_K, 19968, 6656, 4)
    # asked-for warps, capped by the registers a multiprocessor holds: 25 blocks (K = 6,400) take 25
    # warps of Q6_K (28 fit), five of Q4_K (20 fit: the fewest idle below that)
    assert plan.mma_plan(QT.Q6_K, 6400, 6656, 4, h200, KernelConfig(mma_warps=32, mma_tile_warps=32)).warps == 25
    assert plan.mma_plan(QT.Q6_K, 6400, 6656, 4, h200, KernelConfig(mma_warps=16, mma_tile_warps=32)).warps == 5
    assert plan.mma_plan(QT.Q4_K, 6400, 6656, 4, h200, KernelConfig(mma_warps=32, mma_tile_warps=32)).warps == 5
    for qtype, regs in plan.MMA_REGISTERS.items():   # every plan within the registers, K in whole blocks
        for k, n in ((6656, 202048), (19968, 6656), (4096, 6656)):
            for tile_warps in (0, 1, 32):
                p = plan.mma_plan(qtype, k, n, 4, h200, KernelConfig(mma_warps=32, mma_tile_warps=tile_warps))
                assert plan.fits_registers(regs, 32 * p.warps)
                assert (k // 64 // p.parts) % 4 == 0 and p.warps % p.tile_warps == 0
                assert plan.mma_launch(qtype, k, n, h200, KernelConfig(mma_warps=32, mma_tile_warps=tile_warps),
                                       4)[0] == f"matvec_mma_{qtype.name.lower()}"
    assert not Kernels(Device("metal", 64))._takes_mma(QT.Q4_K, 256, 16, 2)


def test_register_rule_counts_the_sub_partitions():
    """fits_registers: a block's warps, rounded up to the register file's four sub-partitions of
    16,384, each taking its registers in units of 256 (cuda_occupancy.h's rule, worked by hand
    here), against the launches seen on an H200 (2026-12-06): 21 warps of an 83-register build
    ("too many resources requested for launch"), where 21 x 32 x 88 = 59,136 registers would have
    fit the whole file; 21 warps of 78 (o_proj's build), 25 of 72 and 20 of 86 launched."""
    assert not plan.fits_registers(83, 21 * 32)          # 24 warps x 2,816 = 67,584
    assert 21 * 32 * 88 <= plan.GROUP_REGISTERS          # what the old rule counted
    for regs, warps in ((78, 21), (72, 25), (86, 20), (64, 32), (255, 8), (168, 10)):
        assert plan.fits_registers(regs, 32 * warps), (regs, warps)
    for regs, warps in ((65, 32), (73, 25), (97, 20), (170, 10), (176, 9)):
        assert not plan.fits_registers(regs, 32 * warps), (regs, warps)
    # threadgroups a multiprocessor holds: 16,384 // registers a warp, times 4, over the warps
    # (88: 5 x 4 = 20 warps, one group of 19; 72: 7 x 4 = 28, two of 13)
    assert plan.groups_by_registers(88, 19 * 32) == 1 and plan.groups_by_registers(72, 13 * 32) == 2
    assert plan.groups_by_registers(32, 4 * 32) == 16 and plan.groups_by_registers(64, 1 * 32) == 32
    # every plan the planner makes fits, at every device size and shape
    for cores in (4, 66, 114, 132):
        device = Device("cuda", cores, 232448)
        for qtype, regs in plan.MMA_REGISTERS.items():
            for k in (768, 4096, 6656, 19968):
                for n in (37, 256, 8448, 39936):
                    for cfg in (KernelConfig(), KernelConfig(mma_warps=32), KernelConfig(mma_tile_warps=32)):
                        p = plan.mma_plan(qtype, k, n, 4, device, cfg)
                        assert plan.fits_registers(regs, 32 * p.warps), (cores, qtype, k, n, cfg, p)
    # the x_shared kernels lower RF where its registers would not fit: three rows at K = 17,408
    # (288 threads: 9 warps, 12 by the sub-partitions) at RF = 2 take 170, 176 x 32 x 12 > 65,536
    p = plan.stream_plan(QT.Q4_K, 17408, 8192, Device("cuda", 132, 232448), KernelConfig(), 3)
    assert p.rows_loaded == 1 and plan.fits_registers(plan.STREAM_BATCH_REGISTERS[QT.Q4_K, 3, 1], 288)


def test_q4k_plans_keep_to_the_checked_warps_a_tile():
    """Left to the planner, Q4_K's block form puts at most MMA_CHECKED_TILE_WARPS (5) warps on a
    tile at every row count and device size (the most its GPU checks have passed). The pinned
    model's Q4_K products on a 132-multiprocessor device keep the plans they were measured with,
    but o_proj's 21 warps, which take 20 since the register rule counts the register file's
    sub-partitions (fits_registers); an explicit mma_tile_warps still decides."""
    limit = plan.MMA_CHECKED_TILE_WARPS[QT.Q4_K]
    assert limit == 5
    for cores in (4, 66, 114, 132):
        device = Device("cuda", cores, 232448)
        for k in (768, 4096, 6656, 19968):
            for n in (37, 256, 512, 1024, 2048, 4096, 8448, 39936):
                for b in (2, 3, 4):
                    p = plan.mma_plan(QT.Q4_K, k, n, b, device, KernelConfig())
                    assert p.tile_warps <= limit, (cores, k, n, b, p)
    h200 = Device("cuda", 132, 232448)
    for (n, k), (warps, parts, tile_warps) in {(39936, 6656): (19, 1, 1), (8448, 6656): (20, 1, 5),
                                               (8704, 6656): (20, 1, 4), (6656, 4096): (20, 8, 1),
                                               (6656, 19968): (19, 6, 1)}.items():
        for b in (2, 3, 4):
            p = plan.mma_plan(QT.Q4_K, k, n, b, h200, KernelConfig())
            assert (p.warps, p.parts, p.tile_warps) == (warps, parts, tile_warps), (n, k, b, p)
    assert plan.mma_plan(QT.Q4_K, 6656, 256, 4, h200, KernelConfig(mma_tile_warps=13)).tile_warps == 13


def test_tensor_core_knobs_route_the_products():
    """mma_min_rows keeps matrices below it on x_shared at three and four rows (V's 256 rows) and
    leaves two rows to mma_pair_min_rows; mma_parts splits K into at least that many parts where
    K's blocks split so (each part's fragments the smaller), else into the fewest that fit. The
    FFN down product over rows that take the tensor cores gets its input from MLX ops and the
    plain form; fewer rows keep the activation in the streaming kernel. The launches are
    recorded, not run (a CUDA plan on a CPU machine)."""
    from muse_mlx.kernels import Kernels
    from muse_mlx.ops.gpu import GpuOps
    from muse_mlx.ops.reference import Matrix, Slice
    h200 = Device("cuda", 132, 232448)
    small = Kernels(h200, KernelConfig(mma_min_rows=1024))
    assert not small._takes_mma(QT.Q6_K, 6656, 256, 3) and not small._takes_mma(QT.Q6_K, 6656, 256, 4)
    assert small._takes_mma(QT.Q4_K, 6656, 8704, 3) and small._takes_mma(QT.Q6_K, 6656, 1024, 4)
    assert Kernels(h200, KernelConfig(mma_min_rows=0))._takes_mma(QT.Q6_K, 6656, 256, 3)
    assert not Kernels(h200)._takes_mma(QT.Q6_K, 6656, 256, 3)   # the default: 1,024
    pair = Kernels(h200, KernelConfig(mma_min_rows=1024, mma_pair_min_rows=16384))   # two rows: the pair knob's
    assert not pair._takes_mma(QT.Q4_K, 6656, 8704, 2) and pair._takes_mma(QT.Q4_K, 6656, 39936, 2)
    # parts of whole blocks, at most plan.MMA_MAX_PARTS (8): 104 units (K = 6,656) split in 1 or 2,
    # 312 (19,968) in 1, 2, 3 or 6
    for k, parts, want in ((6656, 2, 2), (19968, 3, 3), (19968, 4, 6), (19968, 1, 2)):
        p = plan.mma_plan(QT.Q4_K, k, 6656, 4, h200, KernelConfig(mma_parts=parts))
        assert p.parts == want and p.memory == plan.MMA_UNIT_BYTES[QT.Q4_K] * k // 64 // want + 32, (k, parts, p)
    # no count from 3 to 8 splits 6,656's 26 blocks evenly in whole blocks: the fewest that fit (1)
    assert plan.mma_plan(QT.Q4_K, 6656, 39936, 4, h200, KernelConfig(mma_parts=3)).parts == 1

    def launched(config, rows):
        names = []

        def build(name, backend, memory):
            def launch(*, inputs, output_shapes, output_dtypes, **kw):
                names.append(name)
                return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
            return launch
        ops = GpuOps(Kernels(h200, config, build=build))
        k, n = 19968, 6656
        w = Matrix(mx.zeros((n, k // 256 * 144), dtype=mx.uint8), QT.Q4_K, True, k, n)
        gu = mx.ones((rows, 2 * k))
        mx.eval(ops.down_silu(w, Slice(gu, 0, k), Slice(gu, k, k)))
        return names
    assert launched(KernelConfig(), 4) == ["matvec_mma_q4_k"] == launched(KernelConfig(), 3)
    assert launched(KernelConfig(mma_pair_min_rows=0), 2) == ["matvec_mma_q4_k"]
    # where the tensor cores do not take the product (two rows below mma_pair_min_rows, one row, or
    # stream_mma = 0) the activation stays in the streaming kernel
    assert launched(KernelConfig(), 2) == ["matvec_mma_q4_k"]   # the default takes FFN down at two rows
    assert launched(KernelConfig(mma_pair_min_rows=16384), 2) == ["matvec_stream_shared_silu_q4_k"]
    assert launched(KernelConfig(), 1) == ["matvec_stream_silu_q4_k"]
    assert launched(KernelConfig(stream_mma=0), 4) == ["matvec_stream_shared_silu_q4_k"] * 2


@pytest.mark.parametrize("qtype, n, k", [(QT.Q4_K, 39936, 6656), (QT.Q4_K, 8704, 6656), (QT.Q4_K, 6656, 4096),
                                         (QT.Q6_K, 6656, 19968), (QT.Q4_K, 6656, 19968), (QT.Q6_K, 262144, 6656),
                                         (QT.Q4_K, 5, 256)])
def test_tensor_core_tile_split_fits_and_balances(qtype, n, k):
    """The plan's split of warps between tiles (KW a tile, NW / KW tiles a round) at the pinned
    shapes: a whole number of tiles a threadgroup, within the registers and memory of one
    multiprocessor, and no busier warp than any other split of at most as many warps, the
    whole-threadgroup split (one tile at a time) included."""
    h200 = Device("cuda", 132, 232448)
    p = plan.mma_plan(qtype, k, n, 4, h200, KernelConfig())
    limit = max(nw for nw in range(1, plan.MMA_PLANNED_WARPS[qtype] + 1)
                if plan.fits_registers(plan.MMA_REGISTERS[qtype], 32 * nw))
    assert p.warps % p.tile_warps == 0 and p.warps <= limit
    assert p.memory + plan.MMA_WARP_BYTES * p.warps <= h200.group_memory
    tiles, units, groups = -(-n // 16), k // 64 // p.parts, h200.cores // p.parts

    granule = 4   # warps take whole blocks

    def busiest(nw, kw):   # units of K the busiest warp works through, a round's barrier as 2
        return -(-tiles // (groups * (nw // kw))) * (granule * -(-units // (granule * kw)) + (2 if kw > 1 else 0))
    assert p.groups <= groups and p.groups * (p.warps // p.tile_warps) >= tiles or p.groups == groups
    best = busiest(p.warps, p.tile_warps)
    # the fragments and the warps' buffers share the multiprocessor's memory; Q4_K keeps to the
    # warps a tile its GPU checks passed
    room = min(limit, (h200.group_memory - p.memory) // plan.MMA_WARP_BYTES)
    most_kw = plan.MMA_CHECKED_TILE_WARPS.get(qtype, room)
    assert all(best <= busiest(nw, kw) for kw in range(1, min(room, units // granule, most_kw) + 1)
               for nw in range(kw, room + 1, kw))
    whole = plan.mma_plan(qtype, k, n, 4, h200, KernelConfig(mma_tile_warps=32))
    assert best <= busiest(whole.warps, whole.warps)


def test_kernel_config_parses_and_rejects():
    """--kernel-config: defaults, values, and one clear error for each kind of mistake."""
    assert KernelConfig.parse("") == KernelConfig()
    c = KernelConfig.parse("ring_chunk=16, plane_chunk=512,combine_warps=6")
    assert (c.ring_chunk, c.plane_chunk, c.combine_warps, c.stream_groups) == (16, 512, 6, 0)
    for bad, fragment in [("ring_chunk", "name=value"), ("rows=8", "name=value"), ("ring_chunk=x", "integer"),
                          ("ring_chunk=0", "1..65536"), ("combine_warps=33", "0..32"), ("stream_groups=-1", "0.."),
                          ("stream_batch=5", "0..4"), ("stream_batch_rf=3", "0, 1, 2 or 4"),
                          ("stream_batch_rf=8", "0..4"), ("stream_mma=1", "0 \\(never\\)"),
                          ("stream_mma=5", "0..4"), ("mma_warps=33", "0..32"),
                          ("mma_pair_min_rows=-1", "0..16777216"), ("mma_min_rows=-1", "0..16777216"),
                          ("mma_parts=9", "0..8")]:
        with pytest.raises(MuseError, match=fragment):
            KernelConfig.parse(bad)


def test_attention_splits_cover_the_rows_and_change_rarely():
    """A compiled step's split counts (plan.attention_splits): enough for the rows, at most a
    quarter more than needed above 8 splits, never past the storage's, and few distinct counts."""
    for chunk, cap in [(32, 1024), (128, 131072), (128, 300), (7, 100)]:
        counts = [plan.attention_splits(n, chunk, cap) for n in range(1, cap + 1)]
        for n, s in zip(range(1, cap + 1), counts):
            need = -(-n // chunk)
            assert need <= s <= max(need, -(-cap // chunk)) and s <= max(8, need * 1.25), (chunk, cap, n, s)
        assert counts == sorted(counts)
        assert len(set(counts)) <= 8 + 4 * max(0, (-(-cap // chunk)).bit_length() - 3), (chunk, cap, len(set(counts)))
    with pytest.raises(ValueError, match="do not cover"):
        plan.attention_params(300, 32, 9)


def test_plane_chunk_halves_while_the_splits_are_few():
    """plan.plane_chunk: plane_chunk rows a split unless plane_splits_min asks for more splits,
    then halved down to ring_chunk at most; 0 leaves plane_chunk at every depth."""
    on = KernelConfig(ring_chunk=32, plane_chunk=128, plane_splits_min=16)
    # 600 rows: 5 splits of 128, 10 of 64, 19 of 32; 1,023: 8 of 128, 16 of 64; 2,047: 16 of 128
    assert [plan.plane_chunk(n, on) for n in (1, 600, 1023, 1100, 2047, 2100, 131072)] == \
        [32, 32, 64, 64, 128, 128, 128]
    off = KernelConfig(plane_splits_min=0)
    assert {plan.plane_chunk(n, off) for n in (1, 600, 131072)} == {off.plane_chunk}
    assert plan.plane_chunk(5, KernelConfig(ring_chunk=48, plane_chunk=128, plane_splits_min=16)) == 64


def test_combine_warps_scale_with_the_splits():
    """0 (the default): one simdgroup per 16 splits, between 4 and 32; a number is taken as given."""
    auto = KernelConfig()
    assert [plan.combine_warps(n, auto) for n in (1, 64, 65, 257, 512, 513, 8193)] == [4, 4, 5, 17, 32, 32, 32]
    assert plan.combine_warps(257, KernelConfig(combine_warps=6)) == 6
