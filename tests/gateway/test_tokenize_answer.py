"""The compiled reading of an engine's ``/tokenize`` answer
(``_native.tokenize_answer_ids``, serde_json) against msgspec's typed decoding of the same
bytes, the reference: the same ids for every answer both accept, and an error for
every answer msgspec refuses."""

from __future__ import annotations

import json
from typing import Annotated

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream import _native


class _Reference(msgspec.Struct):
    tokens: list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]]


REFERENCE = msgspec.json.Decoder(_Reference)


def _dumps(value: object) -> bytes:
    return json.dumps(value).encode()  # the stdlib writes ints of any size

_id = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 2**32 - 1]))
_bad_id = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32, max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=3), st.none(), st.booleans())
_others = st.dictionaries(st.sampled_from(["count", "max_model_len", "token_strs", "model"]),
                          st.one_of(st.integers(0, 10**6), st.none(), st.text(max_size=5)), max_size=3)


def _answer(data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["good", "bad id", "no tokens", "not a list", "not json", "not an object"]))
    others = data.draw(_others)
    if kind == "good":
        return _dumps({**others, "tokens": data.draw(st.lists(_id, max_size=50))})
    if kind == "bad id":
        ids: list = data.draw(st.lists(_id, max_size=10))
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(_bad_id))
        return _dumps({**others, "tokens": ids})
    if kind == "no tokens":
        return _dumps(others)
    if kind == "not a list":
        return _dumps({**others, "tokens": data.draw(st.one_of(st.integers(), st.text(max_size=4), st.none()))})
    if kind == "not json":
        return data.draw(st.binary(max_size=20)) + b"{"
    return _dumps(data.draw(st.lists(_id, max_size=3)))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_the_compiled_reading_agrees_with_msgspec(data: st.DataObject) -> None:
    answer = _answer(data)
    try:
        want = REFERENCE.decode(answer).tokens
    except msgspec.DecodeError:
        want = None
    try:
        got = np.frombuffer(_native.tokenize_answer_ids(answer), dtype=np.uint32).tolist()
    except ValueError:
        got = None
    assert got == want, answer
