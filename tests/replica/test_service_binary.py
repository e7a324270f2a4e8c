"""POST /v1/route with a binary body (little-endian u32 token ids, the other fields as
query parameters) over a real replica and broker: the same decision as JSON, and bad
bodies refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from kvstream.replica.service import MAX_TOKENS

from tests.replica.test_service import TOKENS, served  # noqa: F401 (the fixture)

pytestmark = pytest.mark.kafka
BINARY = {"Content-Type": "application/octet-stream"}


def packed(tokens: list[int]) -> bytes:
    return np.array(tokens, dtype="<u4").tobytes()


def test_binary_body_decides_as_json_and_tracks_the_request(served) -> None:  # noqa: F811
    replica, client = served
    want = client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True, "explain": True}).json()
    r = client.post("/v1/route?query_only=true&explain=true", content=packed(TOKENS), headers=BINARY)
    assert r.status_code == 200, r.text
    assert r.json() == want
    r = client.post("/v1/route?request_id=b1", content=packed(TOKENS), headers=BINARY)
    assert r.status_code == 200 and r.json()["worker_id"] == 1
    assert replica.router.active_requests() == 1  # tracked (under the replica's scope)
    assert client.post("/v1/route?request_id=b1", content=packed(TOKENS), headers=BINARY).status_code == 409
    assert client.delete("/v1/requests/b1").status_code == 200
    # The ttft policy (decided in Python) takes binary bodies too.
    want = client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True, "policy": "ttft"}).json()
    r = client.post("/v1/route?query_only=true&policy=ttft", content=packed(TOKENS), headers=BINARY)
    assert r.status_code == 200 and r.json() == want


@pytest.mark.parametrize(
    ("path", "body", "status", "reason"),
    [
        ("/v1/route?query_only=true", b"\x01\x00\x00\x00\x02\x00", 400, "not a multiple of 4"),
        ("/v1/route", packed([1, 2]), 422, "a route needs a request_id"),
        ("/v1/route?bogus=1", packed([1, 2]), 422, "bogus"),
        ("/v1/route?request_id=", packed([1, 2]), 422, "request_id"),
        ("/v1/route?query_only=maybe", packed([1, 2]), 422, "query_only"),
        ("/v1/route?policy=fastest", packed([1, 2]), 422, "policy"),
        ("/v1/route?lora_name=" + "x" * 257, packed([1, 2]), 422, "lora_name"),
        ("/v1/route?request_id=a&request_id=b", packed([1, 2]), 422, "given more than once"),
        ("/v1/route?weights=1", packed([1, 2]), 422, "unknown field `weights`"),
        ("/v1/route", bytes(4 * (MAX_TOKENS + 1)), 413, "exceeds"),
    ],
)
def test_bad_binary_bodies_get_4xx_with_the_reason(served, path, body, status, reason) -> None:  # noqa: F811
    replica, client = served
    r = client.post(path, content=body, headers=BINARY)
    assert r.status_code == status, r.text
    assert reason in r.text
    assert replica.router.active_requests() == 0
    assert client.get("/healthz").status_code == 200
