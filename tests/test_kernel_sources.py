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
