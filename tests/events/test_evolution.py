"""Schema evolution both ways, with the test-only v2 in tests/events/data/schemas."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from kvstream.events.codec import EVENT_BATCH, AvroCodec, EventCodec, pack_u64
from kvstream.events.errors import DecodeError
from kvstream.events.model import EventBatch, Removed, Stored, Tier
from kvstream.events.schemas import DEFAULT_SCHEMA_DIR, SchemaStore

V2_DIR = Path(__file__).parent / "data" / "schemas"


@pytest.fixture(scope="module")
def both_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The live schemas plus the test-only v2."""
    root = tmp_path_factory.mktemp("schemas")
    shutil.copytree(DEFAULT_SCHEMA_DIR, root, dirs_exist_ok=True)
    shutil.copytree(V2_DIR, root, dirs_exist_ok=True)
    return root


@pytest.fixture(scope="module")
def old() -> AvroCodec:
    """A process of today: knows v1 only."""
    return AvroCodec(SchemaStore())


@pytest.fixture(scope="module")
def new(both_dir: Path) -> AvroCodec:
    """A process after the upgrade: writes and reads v2."""
    return AvroCodec(SchemaStore(both_dir))


@pytest.fixture(scope="module")
def old_upgraded(both_dir: Path) -> AvroCodec:
    """A reader already given the v2 file but still on v1 (the first rollout step)."""
    return AvroCodec(SchemaStore(both_dir, pins={EVENT_BATCH: 1}))


BATCH = EventBatch(
    9,
    2,
    500,
    (
        Stored(9, 1, Tier.HOST_PINNED, 2, 10, 77, (1, 2), (3, 4)),
        Removed(9, 0, Tier.DEVICE, 2, 11, (1,)),
    ),
)


def v2_event(tier: str, priority: int) -> dict[str, Any]:
    return {
        "dp_rank": 0,
        "tier": tier,
        "event_id": 1,
        "kind": "STORED",
        "parent_hash": None,
        "block_hashes": pack_u64((5,)),
        "tokens_hashes": pack_u64((6,)),
        "priority": priority,
    }


def test_versions_have_distinct_fingerprints(new: AvroCodec, old_upgraded: AvroCodec) -> None:
    v1, v2 = new.store.versions(EVENT_BATCH)
    assert (v1.version, v2.version) == (1, 2)
    assert v1.fingerprint != v2.fingerprint
    assert new.fingerprint(EVENT_BATCH) == v2.fingerprint
    assert old_upgraded.fingerprint(EVENT_BATCH) == v1.fingerprint


def test_old_writer_new_reader(old: AvroCodec, new: AvroCodec) -> None:
    data = EventCodec(old).encode(BATCH)
    name, record = new.decode(data)
    assert name == EVENT_BATCH
    assert [e["priority"] for e in record["events"]] == [0, 0]  # the v2 field's default
    assert EventCodec(new).decode(data) == BATCH


def test_new_writer_old_reader(new: AvroCodec, old_upgraded: AvroCodec) -> None:
    data = EventCodec(new).encode(BATCH)
    assert data[2:10] == new.fingerprint(EVENT_BATCH)
    assert EventCodec(old_upgraded).decode(data) == BATCH

    record = {"worker_id": 9, "epoch": 2, "lease_ms": 500, "events": [v2_event("DISK", 7), v2_event("CXL", 1)]}
    name, got = old_upgraded.decode(new.encode(EVENT_BATCH, record))
    assert name == EVENT_BATCH
    assert [e["tier"] for e in got["events"]] == ["DISK", "UNKNOWN"]  # enum default
    assert all("priority" not in e for e in got["events"])  # added field ignored


def test_old_reader_rejects_event_on_new_tier(new: AvroCodec, old_upgraded: AvroCodec) -> None:
    record = {"worker_id": 9, "epoch": 2, "lease_ms": 500, "events": [v2_event("DISK", 7), v2_event("CXL", 1)]}
    with pytest.raises(DecodeError, match="event 1: tier UNKNOWN") as info:
        EventCodec(old_upgraded).decode(new.encode(EVENT_BATCH, record))
    assert info.value.reason == "invalid"


def test_reader_without_the_writer_schema(new: AvroCodec, old: AvroCodec) -> None:
    with pytest.raises(DecodeError, match="unknown writer schema fingerprint") as info:
        old.decode(EventCodec(new).encode(BATCH))
    assert info.value.reason == "fingerprint"
