//! Reader of `kvstream.events.EventBatch` v1 messages (the layout event_encode.rs
//! writes), for kvstream/events/codec.py's fast path on the read side and the fold's
//! (kvstream/replica/fold.py).
//!
//! It accepts only what the generic path (strict walk, fastavro, the model's checks)
//! decodes into a valid batch, and answers `None` for anything else: the generic path
//! then gives the result or the exact `DecodeError`. Anything unusual (a negative array
//! block count, an `UNKNOWN` symbol, a bad length...) is simply not its business, so it
//! cannot change what is rejected or why; tests/events check it against the generic
//! path on random valid and invalid bytes.
//!
//! Hashes stay packed: an event gives the byte offsets of its hashes in the message,
//! which kvstream._native.IndexCore reads directly, and Python's own `hash()` of the
//! event's model object (the fold's digest of the event applied last), computed with
//! CPython's tuple and int hash so that both paths store the same digest.
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

// CPython's tuple hash (Objects/tupleobject.c, 64-bit) and int hash modulus.
const XXPRIME_1: u64 = 11_400_714_785_074_694_791;
const XXPRIME_2: u64 = 14_029_467_366_897_019_727;
const XXPRIME_5: u64 = 2_870_177_450_012_600_261;
const HASH_MODULUS: u64 = (1 << 61) - 1;

struct TupleHash {
    acc: u64,
    len: u64,
}

impl TupleHash {
    fn new() -> Self {
        TupleHash { acc: XXPRIME_5, len: 0 }
    }

    /// An item whose `hash()` is `lane` (as Py_uhash_t).
    fn lane(&mut self, lane: u64) {
        self.acc = self.acc.wrapping_add(lane.wrapping_mul(XXPRIME_2)).rotate_left(31).wrapping_mul(XXPRIME_1);
        self.len += 1;
    }

    /// A non-negative int (hash: the value modulo 2**61 - 1).
    fn int(&mut self, v: u64) {
        self.lane(v % HASH_MODULUS);
    }

    fn finish(&self) -> u64 {
        let acc = self.acc.wrapping_add(self.len ^ (XXPRIME_5 ^ 3_527_539));
        if acc == u64::MAX {
            1_546_275_796
        } else {
            acc
        }
    }
}

/// `hash()` of a tuple of the packed little-endian u64 in `bytes`.
fn packed_hash(bytes: &[u8]) -> u64 {
    let mut h = TupleHash::new();
    for c in bytes.chunks_exact(8) {
        h.int(u64::from_le_bytes(c.try_into().expect("8-byte chunk")));
    }
    h.finish()
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    /// A zig-zag varint long, within the strict walk's bounds (avro_check.rs).
    fn long(&mut self) -> Option<i64> {
        let mut n: u64 = 0;
        let mut shift = 0u32;
        loop {
            let b = *self.data.get(self.pos)?;
            self.pos += 1;
            if shift == 63 && b & 0xFE != 0 {
                return None;
            }
            n |= u64::from(b & 0x7F) << shift;
            if b & 0x80 == 0 {
                return Some(((n >> 1) as i64) ^ -((n & 1) as i64));
            }
            shift += 7;
        }
    }

    /// Avro `bytes` of packed u64: (offset, count of u64).
    fn packed(&mut self) -> Option<(usize, usize)> {
        let n = usize::try_from(self.long()?).ok()?;
        if n % 8 != 0 || n > self.data.len() - self.pos {
            return None;
        }
        let at = self.pos;
        self.pos += n;
        Some((at, n / 8))
    }

    fn symbol(&mut self, table: &[i8]) -> Option<u8> {
        let i = usize::try_from(self.long()?).ok()?;
        u8::try_from(*table.get(i)?).ok()
    }
}

/// Model kinds (kvstream/events/codec.py's PACKED_KINDS order).
const STORED: u8 = 0;
const REMOVED: u8 = 1;

struct Event {
    kind: u8,
    dp_rank: u32,
    tier: u8,
    event_id: u64,
    parent: Option<u64>,
    blocks_at: usize,
    tokens_at: usize,
    count: usize,
}

/// Reads v1 messages of one schema store: the header to expect, and per enum symbol of
/// the schema its model position (-1: not applicable, e.g. `UNKNOWN`).
#[pyclass(frozen, module = "kvstream._native")]
pub struct EventBatchReader {
    header: Vec<u8>,
    tiers: Vec<i8>,
    kinds: Vec<i8>,
    /// `hash()` of each model tier and of None, for the events' digests.
    tier_hashes: Vec<i64>,
    none_hash: i64,
}

impl EventBatchReader {
    fn read_all(&self, data: &[u8]) -> Option<(u64, u64, u64, Vec<Event>)> {
        if !data.starts_with(&self.header) {
            return None;
        }
        let mut r = Reader { data, pos: self.header.len() };
        let worker_id = r.long()? as u64;
        let epoch = r.long()? as u64;
        let lease_ms = u64::try_from(r.long()?).ok()?;
        let mut events = Vec::new();
        loop {
            let count = usize::try_from(r.long()?).ok()?; // a negative (sized) block: generic path
            if count == 0 {
                break;
            }
            // Every event takes at least 7 bytes: a huge count runs out of input.
            if count > (data.len() - r.pos) / 7 {
                return None;
            }
            events.reserve(count);
            for _ in 0..count {
                let dp_rank = u32::try_from(r.long()?).ok()?;
                let tier = r.symbol(&self.tiers)?;
                let event_id = r.long()? as u64;
                let kind = r.symbol(&self.kinds)?;
                let parent = match r.long()? {
                    0 => None,
                    1 => Some(r.long()? as u64),
                    _ => return None,
                };
                let (blocks_at, count) = r.packed()?;
                let (tokens_at, tokens) = r.packed()?;
                let valid = match kind {
                    STORED => count > 0 && tokens == count,
                    REMOVED => count > 0 && tokens == 0 && parent.is_none(),
                    _ => count == 0 && tokens == 0 && parent.is_none(),
                };
                if !valid {
                    return None;
                }
                events.push(Event { kind, dp_rank, tier, event_id, parent, blocks_at, tokens_at, count });
            }
        }
        if r.pos != data.len() {
            return None;
        }
        Some((worker_id, epoch, lease_ms, events))
    }

    /// Python's `hash()` of the model event (a frozen dataclass: the tuple of its fields).
    fn digest(&self, data: &[u8], worker_id: u64, epoch: u64, ev: &Event) -> i64 {
        let mut h = TupleHash::new();
        h.int(worker_id);
        h.int(u64::from(ev.dp_rank));
        h.lane(self.tier_hashes[usize::from(ev.tier)] as u64);
        h.int(epoch);
        h.int(ev.event_id);
        let blocks = &data[ev.blocks_at..ev.blocks_at + 8 * ev.count];
        match ev.kind {
            STORED => {
                match ev.parent {
                    None => h.lane(self.none_hash as u64),
                    Some(p) => h.int(p),
                }
                h.lane(packed_hash(blocks));
                h.lane(packed_hash(&data[ev.tokens_at..ev.tokens_at + 8 * ev.count]));
            }
            REMOVED => h.lane(packed_hash(blocks)),
            _ => {}
        }
        h.finish() as i64
    }
}

#[pymethods]
impl EventBatchReader {
    /// `tiers` / `kinds`: per symbol of the schema's Tier / Kind enum, its position in
    /// the model's order (-1 where it has none); `tier_hashes`: `hash()` of each model
    /// tier; `none_hash`: `hash(None)`.
    #[new]
    fn new(header: Vec<u8>, tiers: Vec<i8>, kinds: Vec<i8>, tier_hashes: Vec<i64>, none_hash: i64) -> PyResult<Self> {
        let tiers_ok = tiers.iter().all(|&t| t < 0 || (t as usize) < tier_hashes.len());
        let kinds_ok = kinds.iter().all(|&k| k <= 2);
        if !tiers_ok || !kinds_ok {
            return Err(PyValueError::new_err("symbol positions out of range"));
        }
        Ok(Self { header, tiers, kinds, tier_hashes, none_hash })
    }

    /// `(worker_id, epoch, lease_ms, events)` of a valid v1 message, each event
    /// `(kind, dp_rank, tier, event_id, parent_hash, blocks_at, tokens_at, count,
    /// digest)`; None for anything else.
    fn read<'py>(&self, py: Python<'py>, data: &[u8]) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let Some((worker_id, epoch, lease_ms, events)) = self.read_all(data) else {
            return Ok(None);
        };
        let mut items = Vec::with_capacity(events.len());
        for ev in &events {
            let digest = self.digest(data, worker_id, epoch, ev);
            items.push(
                (ev.kind, ev.dp_rank, ev.tier, ev.event_id, ev.parent, ev.blocks_at, ev.tokens_at, ev.count, digest)
                    .into_pyobject(py)?,
            );
        }
        Ok(Some((worker_id, epoch, lease_ms, PyTuple::new(py, items)?).into_pyobject(py)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPython 3.11's values: hash(()), hash((1, 2)), hash((2**61 - 1, 2**64 - 1)).
    #[test]
    fn tuple_hash_is_cpythons() {
        assert_eq!(TupleHash::new().finish() as i64, 5_740_354_900_026_072_187);
        let mut h = TupleHash::new();
        h.int(1);
        h.int(2);
        assert_eq!(h.finish() as i64, -3_550_055_125_485_641_917);
        let mut packed = Vec::new();
        packed.extend_from_slice(&((1u64 << 61) - 1).to_le_bytes());
        packed.extend_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(packed_hash(&packed) as i64, -5_903_513_032_161_352_639);
    }

    #[test]
    fn lengths_past_the_input_are_not_taken() {
        let mut r = Reader { data: &[0x70, 1, 2], pos: 0 }; // 56 bytes announced, 2 left
        assert!(r.packed().is_none());
        let mut r = Reader { data: &[0x10, 0, 0, 0, 0, 0, 0, 0, 0], pos: 0 }; // 8 bytes
        assert_eq!(r.packed(), Some((1, 1)));
        let mut r = Reader { data: &[0x80; 11], pos: 0 }; // a varint past 64 bits
        assert!(r.long().is_none());
    }
}
