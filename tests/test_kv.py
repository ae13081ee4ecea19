"""Rings and planes: positions, wrapping multi-token writes, and byte accounting."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muse_mlx.errors import ContextLimitError
from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY
from muse_mlx.geometry import PINNED
from muse_mlx.kv import GrowingPlane, SlidingRing, SlotCache


def rows_for(positions, n_kv=2, hd=4):
    """K|V rows (2, n_kv, L, hd) whose K values encode their absolute position (exact in f16
    below 2048), V the negated K."""
    p = np.asarray(positions, dtype=np.float32)
    k = np.broadcast_to(p[None, :, None], (n_kv, len(p), hd)).astype(np.float16)
    return mx.array(np.stack([k, -k]))


def held(layer):
    kv, pos = layer.view()
    kv = np.array(kv.astype(mx.float32))
    return {int(p): float(kv[0, 0, i, 0]) for i, p in enumerate(pos)}, kv[1]


@settings(max_examples=80, deadline=None)
@given(capacity=st.integers(1, 12), chunks=st.lists(st.integers(1, 30), min_size=1, max_size=8))
def test_ring_holds_exactly_the_last_capacity_positions(capacity, chunks):
    ring = SlidingRing(2, 4, capacity, window=capacity)
    written = 0
    for n in chunks:
        ring.append(rows_for(range(written, written + n)))
        written += n
        mapping, values = held(ring)
        expected = list(range(max(0, written - capacity), written))
        assert sorted(mapping) == expected  # the newest `capacity` positions, nothing else
        assert all(mapping[p] == p for p in mapping)  # each row holds its own position's K
        assert ring.offset == written
        assert ring.write_pointer == written % capacity
        assert ring.origin == expected[0]
        k = np.array(ring.view()[0][0].astype(mx.float32))
        assert np.array_equal(values, -k)


def test_ring_row_of_a_position_is_fixed():
    """Position p lives in row p % capacity: the rotation is a function of offset alone."""
    ring = SlidingRing(1, 2, 5, window=5)
    ring.append(rows_for(range(13), n_kv=1, hd=2))
    k = np.array(ring.keys.astype(mx.float32))[0, :, 0]
    assert list(k) == [10, 11, 12, 8, 9]


def test_plane_grows_to_capacity_then_refuses():
    plane = GrowingPlane(2, 4, 10)
    plane.append(rows_for(range(6)))
    plane.append(rows_for(range(6, 10)))
    mapping, _ = held(plane)
    assert mapping == {p: p for p in range(10)}
    with pytest.raises(ContextLimitError):
        plane.append(rows_for([10]))


def test_slot_bytes_match_the_formula_at_the_pinned_geometry():
    """Exact accounting of what would be allocated (MLX allocates lazily): DESIGN.md §3."""
    for context, expected in [(8_192, 190_840_832), (32_768, 517_996_544), (131_072, 1_826_619_392)]:
        cache = SlotCache(PINNED, context)
        assert cache.nbytes == expected == PINNED.slot_kv_bytes(context)
        assert (39 * min(context, 2048) + 13 * context) * 1024 == expected
    assert 4 * SlotCache(PINNED, 131_072).nbytes == 7_306_477_568
    kinds = SlotCache(PINNED, 131_072).bytes_by_kind()
    assert kinds == {"sliding": 39 * 2048 * 1024, "full": 13 * 131_072 * 1024}


@pytest.mark.parametrize("context", [16, 64, 100, 1000])
def test_slot_allocation_matches_the_formula(context):
    """Allocate for real and watch MLX's active memory grow by the formula's bytes."""
    g = DEFAULT_GEOMETRY
    mx.clear_cache()
    before = mx.get_active_memory()
    cache = SlotCache(g, context)
    mx.eval(cache.state())
    grown = mx.get_active_memory() - before
    expected = (g.n_swa * min(context, g.sliding_window) + g.n_full * context) * 2 * g.n_head_kv * g.head_dim * 2
    assert cache.nbytes == expected
    assert expected <= grown <= expected + 64 * 1024 * len(cache.layers) * 2  # allocator rounding only
    del cache


def test_slot_room():
    cache = SlotCache(DEFAULT_GEOMETRY, 70)
    cache.check_room(70)
    with pytest.raises(ContextLimitError, match="70"):
        cache.check_room(71)


@pytest.mark.parametrize("prompt_len", [5, 64, 100])   # under, at and past the fixture's window of 64
def test_a_copied_cache_continues_as_the_original(f32_fixture, prompt_len):
    """SlotCache.copy_from (the server's n choices): a cache copied from one that prefilled a prompt,
    its sliding rings wrapped or not, gives the original's next logits bit for bit, and writing on
    in the original leaves the copy as it was."""
    from muse_mlx.model import load

    model = load(f32_fixture, backend="reference")
    ids = [int(t) for t in np.random.default_rng(prompt_len).integers(0, 256, prompt_len)]
    source, copy = model.make_cache(256), model.make_cache(256)
    model.prefill(ids, source)
    copy.copy_from(source)
    assert copy.offset == source.offset == prompt_len
    step = mx.array([[7]], dtype=mx.int32)
    again = model.make_cache(256)
    again.copy_from(source)
    a = np.array(model(step, [source]))
    b = np.array(model(step, [copy]))
    assert np.array_equal(a, b)
    model(mx.array([[9]], dtype=mx.int32), [source])   # the original writes on; the second copy is untouched
    assert np.array_equal(np.array(model(step, [again])), a)
    with pytest.raises(ValueError, match="same geometry"):
        model.make_cache(128).copy_from(source)
