"""Stop strings matched across token boundaries (slots.StopMatcher), against their definitions."""

from hypothesis import given, settings
from hypothesis import strategies as st

from muse_mlx.slots import StopMatcher, _overlap

TEXTS = st.text(alphabet="abé\n", max_size=14)
STOPS = st.text(alphabet="abé\n", min_size=1, max_size=8)


def overlap_by_definition(text: str, stop: str) -> int:
    """The largest k < len(stop), k <= len(text), whose first k characters of stop end text."""
    return max((k for k in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:k])), default=0)


@settings(max_examples=500, deadline=None)
@given(TEXTS, STOPS)
def test_overlap_is_the_longest_end_that_begins_the_stop(text, stop):
    assert _overlap(text, stop) == overlap_by_definition(text, stop)


@settings(max_examples=500, deadline=None)
@given(st.lists(TEXTS, max_size=8), st.lists(STOPS.filter(lambda s: len(s) <= 5), max_size=3))
def test_the_matcher_releases_the_text_up_to_a_stop_and_never_past_it(pieces, stops):
    """What StopMatcher releases, piece by piece, is always a beginning of the text and holds no
    stop string; with none in the text, all of it (with the flush); when it stops, what it withheld
    begins with a stop string."""
    m, out, whole, stopped = StopMatcher(stops), "", "", False
    for piece in pieces:
        whole += piece
        text, stopped = m.push(piece)
        out += text
        assert whole.startswith(out)
        if stopped:
            break
    if stopped:
        assert any(whole[len(out):].startswith(s) for s in stops)
    else:
        out += m.flush()
        assert out == whole and not any(s in whole for s in stops)
    assert not any(s in out for s in stops)
