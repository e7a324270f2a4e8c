"""The relay's reading of a stream's ``usage`` (kvstream.gateway.relay.stream_usage over
the kept tail) against the plain reading: split the whole stream into its events and
take the last ``data:`` event whose ``usage`` is an object."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.gateway.relay import _Tail, stream_usage


def reference_usage(stream: bytes) -> dict | None:
    for event in reversed(stream.replace(b"\r\n", b"\n").split(b"\n\n")):
        if event.startswith(b"data:") and b'"usage"' in event:
            try:
                usage = orjson.loads(event[5:].strip()).get("usage")
            except (orjson.JSONDecodeError, AttributeError):
                continue
            if isinstance(usage, dict):
                return usage
    return None


_usage = st.one_of(
    st.none(),
    st.fixed_dictionaries({"prompt_tokens": st.integers(0, 10**6), "completion_tokens": st.integers(0, 10**4)}),
)
# Text that holds what the search looks for (quotes, "usage", "data:", newlines: JSON
# escapes them all but the words).
_text = st.lists(st.sampled_from(['a', ' ', '"', '\\', 'usage', '"usage"', 'data:', '\n', '{', '}']), max_size=12).map("".join)
_event = st.one_of(
    st.builds(lambda t: {"choices": [{"text": t}]}, _text),
    st.builds(lambda t, u: {"choices": [{"text": t}], "usage": u}, _text, _usage),
    st.builds(lambda u: {"choices": [], "usage": u}, _usage),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=30), st.booleans(), st.lists(st.integers(1, 64), min_size=1, max_size=8))
def test_usage_of_the_tail_is_that_of_the_whole_stream(events: list[dict], crlf: bool, cuts: list[int]) -> None:
    nl = b"\r\n" if crlf else b"\n"
    stream = b"".join(b"data: " + orjson.dumps(e) + nl + nl for e in events) + b"data: [DONE]" + nl + nl
    # The stream as it arrives, in pieces of any size, through a tail that keeps all of it.
    tail = _Tail(len(stream) + 1)
    at = 0
    for n in cuts * (len(stream) // sum(cuts) + 1):
        if at >= len(stream):
            break
        tail.add(stream[at:at + n])
        at += n
    assert bytes(tail) == stream
    assert stream_usage(bytes(tail)) == reference_usage(stream)


@given(st.lists(st.binary(min_size=1, max_size=50), min_size=1, max_size=60), st.integers(1, 200))
def test_the_tail_keeps_at_least_its_limit_of_the_last_bytes(chunks: list[bytes], limit: int) -> None:
    tail = _Tail(limit)
    for c in chunks:
        tail.add(c)
    whole = b"".join(chunks)
    kept = bytes(tail)
    assert whole.endswith(kept)
    assert len(kept) >= min(limit, len(whole))
    assert len(kept) < limit + 50  # at most one chunk more than asked
