"""The kernel sources without a GPU: one body per kernel for both backends, and the dispatch rules.

The kernels themselves run in tests/gpu (on the H200); here we check what can be checked on
a CPU: the Metal and CUDA instantiations share their bodies, the Metal source names the
thread attributes MLX must add, and the engine falls back to the reference path.
"""

import pytest

from muse_mlx import kernels
from muse_mlx.model import load


@pytest.mark.parametrize("name", list(kernels.KERNELS))
def test_metal_and_cuda_share_the_body(name):
    family, parts, _, _ = kernels.KERNELS[name]
    body = kernels.strip_comments("".join(kernels.sections(family)[p] for p in parts))
    for which in ("metal", "cuda"):
        header, source = kernels.render(family, parts, which)
        assert source.endswith(body)
        assert source[: -len(body)].strip() == kernels.strip_comments(kernels._read(f"indices_{which}.h")).strip()
        assert header.startswith(kernels.strip_comments(kernels._read(f"dialect_{which}.h")))


@pytest.mark.parametrize("name", list(kernels.KERNELS))
def test_metal_source_names_its_thread_attributes(name):
    """MLX adds a Metal attribute only when its name is in the source text (DESIGN.md §4)."""
    family, parts, _, _ = kernels.KERNELS[name]
    _, source = kernels.render(family, parts, "metal")
    body = "".join(kernels.sections(family)[p] for p in parts)
    uses = {"LANE": "thread_index_in_simdgroup", "WARP": "simdgroup_index_in_threadgroup",
            "GROUP_X": "threadgroup_position_in_grid", "THREAD_X": "thread_position_in_threadgroup",
            "NUM_GROUPS_X": "threadgroups_per_grid"}
    for macro, attribute in uses.items():
        if macro in body:
            assert attribute in source
    assert "uint " not in body  # NVRTC has no `uint`; the bodies use uint32_t


def test_no_backend_on_cpu_means_reference_path(f32_fixture, monkeypatch):
    assert kernels.backend() is None  # CI has neither Metal nor CUDA
    model = load(f32_fixture)
    assert model.backend is None and model.path.startswith("MLX ops")
    assert all(not p.use_kernels for p in model.projections())
    with pytest.raises(RuntimeError, match="Metal or CUDA"):
        load(f32_fixture, use_kernels=True)


def test_reference_switch(monkeypatch):
    monkeypatch.setenv("MUSE_MLX_REFERENCE", "1")
    assert kernels.backend() is None


def test_stream_threads_hold_one_unit_each():
    """One 64-value unit of K per thread at the pinned shapes (the x values stay in registers)."""
    assert [kernels.stream_threads(k) for k in (4096, 6656, 19968)] == [64, 128, 320]
    assert kernels.stream_threads(256) == 32          # the fixtures: 4 units, one simdgroup
    assert kernels.stream_threads(32768) == 512
    assert kernels.stream_threads(33024) is None      # 516 units: matvec.inc takes it


@pytest.mark.parametrize("loop", ["stream", "staged", "sharedx"])
@pytest.mark.parametrize("which", ["cuda", "metal"])
def test_stream_plans_fit_the_hardware(loop, which, monkeypatch):
    """Every streaming-matvec plan at the pinned shapes (and the widest K) stays within what a
    launch can have: on CUDA, the planned threadgroups per multiprocessor fit its 228 KB of
    shared memory and 2,048 threads, and no dynamic shared memory past 227 KB a threadgroup;
    on Metal, nothing dynamic and the staged rows / shared x within 32 KB; R a multiple of RF."""
    from gguf import GGMLQuantizationType as QT

    monkeypatch.setenv("MUSE_MLX_MATVEC", loop)
    monkeypatch.setattr(kernels, "backend", lambda: which)
    shapes = [(QT.Q4_K, 6656, 8448), (QT.Q4_K, 4096, 6656), (QT.Q4_K, 6656, 39936), (QT.Q4_K, 19968, 6656),
              (QT.Q6_K, 19968, 6656), (QT.Q6_K, 6656, 256), (QT.Q6_K, 6656, 202048), (QT.Q4_K, 32768, 9),
              (QT.Q6_K, 32768, 9), (QT.Q4_K, 256, 37)]
    for qtype, K, N in shapes:
        plan = kernels.stream_plan(qtype, K, N)
        tpg = kernels.stream_threads(K)
        assert plan.rows % plan.rows_loaded == 0 and 1 <= plan.groups <= -(-N // plan.rows)
        row_bytes = K // 256 * kernels.QT_ROW_BYTES_PER_256[qtype]
        if which == "metal":
            assert plan.shared_bytes == 0
            if plan.loop == "staged":
                assert plan.stages == 1 and plan.rows * row_bytes + 32 <= 32 * 1024
            if plan.loop == "sharedx":
                assert K * 4 <= 32 * 1024
            continue
        assert plan.shared_bytes <= 227 * 1024
        resident = min(plan.groups, kernels.CUDA_MULTIPROCESSORS * max(1, 2048 // tpg))
        per_sm = -(-resident // kernels.CUDA_MULTIPROCESSORS)
        assert per_sm * tpg <= 2048
        assert per_sm * (plan.shared_bytes + 1024) <= 228 * 1024 or plan.loop == "stream"


@pytest.mark.parametrize("which", ["cuda", "metal"])
def test_small_matrices_get_a_row_group_per_core(which, monkeypatch):
    """A streaming matvec over few rows (V: 256) does not leave multiprocessors idle while each
    group walks its rows in turn: rows per group shrink (to 2 at least) until there are as many
    row groups as cores, or the rows run out; large matrices keep the variant's R."""
    from gguf import GGMLQuantizationType as QT

    monkeypatch.setenv("MUSE_MLX_MATVEC", "stream")
    monkeypatch.setattr(kernels, "backend", lambda: which)
    cores = kernels.stream_cores(which)
    for qtype in (QT.Q4_K, QT.Q6_K):
        R0, RF0 = kernels.STREAM_VARIANTS[qtype][1:]
        for N in (1, 37, 256, 4096, 39936):
            plan = kernels.stream_plan(qtype, 6656, N)
            assert plan.rows % plan.rows_loaded == 0 and plan.rows_loaded <= RF0
            if -(-N // R0) >= cores:
                assert plan.rows == R0
            else:
                assert plan.rows < R0 and (plan.rows == 2 or -(-N // plan.rows) >= cores)


def test_attention_knobs_parse_and_reject(monkeypatch):
    """MUSE_MLX_ATTN_CHUNK and MUSE_MLX_COMBINE_WARPS: defaults, values, and one clear error each."""
    for var in ("MUSE_MLX_ATTN_CHUNK", "MUSE_MLX_COMBINE_WARPS"):
        monkeypatch.delenv(var, raising=False)
    s = kernels.settings()
    assert (s.attn_chunks, s.combine_warps, s.attn_loop) == ((kernels.RING_CHUNK, kernels.PLANE_CHUNK), 0, "butterfly")
    monkeypatch.setenv("MUSE_MLX_ATTN_CHUNK", "16,512")
    monkeypatch.setenv("MUSE_MLX_COMBINE_WARPS", "auto")
    s = kernels.settings()
    assert (s.attn_chunks, s.combine_warps) == ((16, 512), 0)
    for bad in ("16", "16,0", "a,b", "16,64,2", "-1,64"):
        monkeypatch.setenv("MUSE_MLX_ATTN_CHUNK", bad)
        with pytest.raises(ValueError, match="MUSE_MLX_ATTN_CHUNK"):
            kernels.settings()
    monkeypatch.delenv("MUSE_MLX_ATTN_CHUNK")
    for bad in ("33", "x", "-4"):
        monkeypatch.setenv("MUSE_MLX_COMBINE_WARPS", bad)
        with pytest.raises(ValueError, match="MUSE_MLX_COMBINE_WARPS"):
            kernels.settings()


@pytest.mark.parametrize("var, field, default", [("MUSE_MLX_FUSE_NORM", "fuse_norm", False),
                                                ("MUSE_MLX_COMPILE", "compile_step", True)])
def test_on_off_knobs(monkeypatch, var, field, default):
    """The 0/1 knobs: their default when unset, the other value when set, a clear error otherwise."""
    monkeypatch.delenv(var, raising=False)
    assert getattr(kernels.settings(), field) is default
    monkeypatch.setenv(var, "1" if not default else "0")
    assert getattr(kernels.settings(), field) is (not default)
    monkeypatch.setenv(var, "yes")
    with pytest.raises(ValueError, match=var):
        kernels.settings()


def test_attention_splits_cover_the_rows_and_change_rarely():
    """A compiled step's split counts (kernels.attention_splits): enough for the rows, at most a
    quarter more than needed above 8 splits, never past the storage's, and few distinct counts."""
    for chunk, cap in [(32, 1024), (128, 131072), (128, 300), (7, 100)]:
        counts = [kernels.attention_splits(n, chunk, cap) for n in range(1, cap + 1)]
        for n, s in zip(range(1, cap + 1), counts):
            need = -(-n // chunk)
            assert need <= s <= max(need, -(-cap // chunk)) and s <= max(8, need * 1.25), (chunk, cap, n, s)
        assert counts == sorted(counts)
        assert len(set(counts)) <= 8 + 4 * max(0, (-(-cap // chunk)).bit_length() - 3), (chunk, cap, len(set(counts)))
    with pytest.raises(ValueError, match="do not cover"):
        kernels.attention_params(300, 32, 9)


def test_only_the_fused_prologue_gets_a_register_cap():
    """The __launch_bounds__ redefinition (kernels.render) goes only into the CUDA header of the
    kernels with the x_resnorm prologue: the others keep the code the GPU checks ran."""
    for name, (family, parts, _, _) in kernels.KERNELS.items():
        header, _ = kernels.render(family, parts, "cuda")
        assert ("__launch_bounds__" in header) == ("x_resnorm" in parts), name
        assert "__launch_bounds__" not in kernels.render(family, parts, "metal")[0]


def test_combine_warps_scale_with_the_splits():
    """auto (0, the default): one simdgroup per 16 splits, between 4 and 32; a number is taken as given."""
    assert [kernels.combine_warps(n, 0) for n in (1, 64, 65, 257, 512, 513, 8193)] == [4, 4, 5, 17, 32, 32, 32]
    assert kernels.combine_warps(257, 6) == 6
