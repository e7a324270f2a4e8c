//! Predicted blocks (issue 33), held beside the tier indexes (index.rs): when a request
//! is routed to a worker slot, the positions (sequence hashes) of its prompt's blocks
//! that the slot does not hold yet become *expected* there, because the engine is about
//! to compute them. Routing counts them at once, instead of waiting for the engine's
//! events to come back through the log.
//!
//! An expectation ends when the slot stores that position on any tier (confirmed: the
//! index knows it now, and a later remove must not be undone by the prediction), when
//! the request that made it fails before its prompt was computed (refuted), when the
//! slot is cleared, when it is older than the TTL (log time: the routing replica's
//! clock), or when the slot holds more than its capacity (the oldest go first, the
//! deepest of one prompt before its prefix, so what is left stays a prefix).
//! tests/router/reference.py holds the plain model the property tests check this against.
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::index::Map;
use crate::table::Table;

/// A timestamp ordered totally (heaps' keys).
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) struct Stamp(pub(crate) f64);
impl Eq for Stamp {}
impl PartialOrd for Stamp {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Stamp {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// One slot's expectations.
#[derive(Default)]
struct Slot {
    /// position → (when it was last routed, the serial of its live heap entry).
    at: Table<(f64, u64)>,
    /// Oldest first; entries whose serial is no longer the position's are stale.
    heap: BinaryHeap<Reverse<(Stamp, u64, u64)>>,
    /// Most positions held (None: the default).
    cap: Option<usize>,
}

impl Slot {
    /// The heap keeps at most about twice the live entries: refreshes leave stale ones.
    fn compact(&mut self) {
        if self.heap.len() > 2 * self.at.len() + 64 {
            self.heap = self.at.iter().map(|(pos, (t, serial))| Reverse((Stamp(t), serial, pos))).collect();
        }
    }

    /// The oldest live entry, dropping stale ones on the way.
    fn oldest(&mut self) -> Option<(f64, u64)> {
        while let Some(&Reverse((Stamp(t), serial, pos))) = self.heap.peek() {
            if self.at.get(&pos).is_some_and(|&(_, s)| s == serial) {
                return Some((t, pos));
            }
            self.heap.pop();
        }
        None
    }
}

/// Every slot's expectations, and per group of 64 slots the mask of the slots expecting
/// each position (what matching reads, one lookup per position like the tiers' owners).
pub(crate) struct Expect {
    ttl: f64,
    default_cap: usize,
    slots: Vec<Slot>,
    owners: Vec<Map<u64, u64>>,
    serial: u64,
    /// Entries over every slot.
    len: usize,
    /// No entry expires before this (log time); lowered by an older stamp's add.
    due: f64,
}

impl Expect {
    pub(crate) fn new(ttl: f64, default_cap: usize) -> Self {
        Expect { ttl, default_cap, slots: Vec::new(), owners: Vec::new(), serial: 0, len: 0, due: f64::INFINITY }
    }

    pub(crate) fn set_ttl(&mut self, ttl: f64) {
        self.ttl = ttl;
        self.due = f64::NEG_INFINITY; // recomputed at the next expiry
    }

    pub(crate) fn set_default_cap(&mut self, cap: usize) {
        self.default_cap = cap;
        for slot in 0..self.slots.len() {
            self.trim(slot);
        }
    }

    pub(crate) fn set_cap(&mut self, slot: usize, cap: Option<usize>) {
        self.ensure(slot);
        self.slots[slot].cap = cap;
        self.trim(slot);
    }

    fn ensure(&mut self, slot: usize) {
        if self.slots.len() <= slot {
            self.slots.resize_with(slot + 1, Slot::default);
        }
        let group = slot / 64;
        if self.owners.len() <= group {
            self.owners.resize_with(group + 1, Map::default);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn count(&self, slot: usize) -> usize {
        self.slots.get(slot).map_or(0, |s| s.at.len())
    }

    /// Whether any slot of `group` expects anything (matching skips the lookup if not).
    #[inline]
    pub(crate) fn group_masks(&self, group: usize) -> Option<&Map<u64, u64>> {
        self.owners.get(group).filter(|m| !m.is_empty())
    }

    /// Expect `seqs[from..]` on `slot` as routed at `t`: new positions are added, known
    /// ones refreshed when `t` is later. Deeper positions get lower serials, so that of
    /// equal stamps the deepest is dropped first at the capacity.
    pub(crate) fn add(&mut self, slot: usize, seqs: &[u64], from: usize, t: f64) {
        if from >= seqs.len() {
            return;
        }
        self.ensure(slot);
        let bit = 1u64 << (slot % 64);
        let owners = &mut self.owners[slot / 64];
        let s = &mut self.slots[slot];
        for &pos in seqs[from..].iter().rev() {
            self.serial += 1;
            match s.at.get(&pos).copied() {
                Some((old, _)) if old >= t => continue,
                Some(_) => {}
                None => {
                    *owners.entry(pos).or_insert(0) |= bit;
                    self.len += 1;
                }
            }
            s.at.insert(pos, (t, self.serial));
            s.heap.push(Reverse((Stamp(t), self.serial, pos)));
        }
        if t + self.ttl < self.due {
            self.due = t + self.ttl;
        }
        self.trim(slot);
        self.slots[slot].compact();
    }

    /// Drop the oldest entries of `slot` beyond its capacity.
    fn trim(&mut self, slot: usize) {
        let Some(s) = self.slots.get_mut(slot) else { return };
        let cap = s.cap.unwrap_or(self.default_cap);
        while s.at.len() > cap {
            let Some((_, pos)) = s.oldest() else { break };
            s.heap.pop();
            s.at.remove(&pos);
            self.len -= 1;
            clear_bit(&mut self.owners[slot / 64], slot, pos);
        }
    }

    /// The slot stored (or no longer expects) `pos`: drop its expectation.
    #[inline]
    pub(crate) fn drop_position(&mut self, slot: usize, pos: u64) {
        let Some(s) = self.slots.get_mut(slot) else { return };
        if s.at.is_empty() {
            return;
        }
        if s.at.remove(&pos).is_some() {
            self.len -= 1;
            clear_bit(&mut self.owners[slot / 64], slot, pos);
        }
    }

    /// Drop every expectation of `slot`.
    pub(crate) fn clear(&mut self, slot: usize) {
        let Some(s) = self.slots.get_mut(slot) else { return };
        let at = std::mem::take(&mut s.at);
        s.heap = BinaryHeap::new();
        self.len -= at.len();
        let owners = &mut self.owners[slot / 64];
        for (pos, _) in at.iter() {
            clear_bit(owners, slot, pos);
        }
    }

    /// Drop every entry routed more than the TTL before `now` (`now - t > ttl`).
    pub(crate) fn expire(&mut self, now: f64) {
        if !(now - self.due > 0.0) && self.due != f64::NEG_INFINITY {
            return;
        }
        let mut due = f64::INFINITY;
        for slot in 0..self.slots.len() {
            let s = &mut self.slots[slot];
            if s.at.is_empty() {
                continue;
            }
            while let Some((t, pos)) = s.oldest() {
                if !(now - t > self.ttl) {
                    due = due.min(t + self.ttl);
                    break;
                }
                s.heap.pop();
                s.at.remove(&pos);
                self.len -= 1;
                clear_bit(&mut self.owners[slot / 64], slot, pos);
            }
            s.compact();
        }
        self.due = due;
    }

    /// Bytes held (for the memory figures): per entry its table slot, its heap entry
    /// and its share of the group's mask map.
    pub(crate) fn heap_bytes(&self) -> usize {
        let slots: usize = self.slots.iter().map(|s| s.at.capacity() * 24 + s.heap.capacity() * 24).sum();
        let owners: usize = self.owners.iter().map(|m| m.capacity() * 8 / 7 * 17).sum();
        slots + owners + self.slots.capacity() * std::mem::size_of::<Slot>()
    }
}

fn clear_bit(owners: &mut Map<u64, u64>, slot: usize, pos: u64) {
    if let Some(m) = owners.get_mut(&pos) {
        *m &= !(1u64 << (slot % 64));
        if *m == 0 {
            owners.remove(&pos);
        }
    }
}
