//! Core of the tier indexes (DESIGN.md §4), called from kvstream/router/index.py, which
//! names workers (slots), dispatches events and keeps the counters. This is the one
//! implementation of the index rules; tests/router/reference.py is the plain model the
//! property tests check it against.
//!
//! A block's position is its chained sequence hash, computed here from the parent's
//! sequence hash. Per tier, `owners` maps a position to the bitmask of the worker slots
//! holding it there (per group of 64 slots: a table for the device tier, one for
//! host_pinned and disk together, one for external; see `Owners`). Each slot has, per
//! tier, a reverse map from its block hashes to positions, so that removing a block or a
//! worker costs O(its blocks). All are table.rs tables.
//! A slot holds a position while at least one of its block hashes maps there; the rare
//! second identity at one position (an alias) is counted in a side map.
//!
//! Snapshots (kvstream/replica/snapshot.py) hold each slot's reverse tables as raw
//! arrays (`export_tables`, `WorkerTables`): a restore copies them and then builds the
//! owners tables they imply in one sorted pass per group and tier (`install`), instead
//! of one insert per block into each.
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::expect::Expect;
use crate::table::{mix, unmix, Table};
use crate::{chain, sequence_of, u64_at};

/// Keys are hashes (or small engine ids): one splitmix64 finalizer spreads them well
/// enough for the table and costs a few ns, against SipHash's tens.
#[derive(Default)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x1000_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

pub(crate) type Map<K, V> = HashMap<K, V, BuildHasherDefault<MixHasher>>;

const TIERS: usize = 4;
/// What matching credits per slot: the tiers in order, then the expected blocks
/// (expect.rs), which continue a prefix where the stored tiers stop.
pub(crate) const COLS: usize = TIERS + 1;
/// Prompt positions looked up at once while matching.
const LOOKAHEAD: usize = 16;

/// Outcome codes of `store` (kvstream/router/index.py maps them to counter reasons).
const STORED: u8 = 0;
const INVALID: u8 = 1;
const PARENT_NOT_FOUND: u8 = 2;

/// One tier's maps.
#[derive(Default)]
struct Tier {
    /// Per slot: block hash → position.
    blocks: Vec<Table<u64>>,
    /// slot → {position: identities beyond the first}.
    aliases: Map<u64, Map<u64, u32>>,
}

/// One group of 64 slots' owners: per tier, position → bitmask of the slots holding it
/// there. host_pinned and disk share a table, an entry holding both masks: an offload
/// engine's disk usually holds what its host tier holds and more, so most of their
/// positions cost one 24-byte entry instead of two of 16 (a position on one of them
/// only costs 24 instead of 16), and matching finds both tiers' masks with one lookup
/// (one cache miss) per position.
#[derive(Default)]
struct Owners {
    device: Table<u64>,
    lower: Table<[u64; 2]>,
    external: Table<u64>,
}

impl Owners {
    fn get(&self, tier: usize, s: &u64) -> u64 {
        match tier {
            0 => self.device.get(s).copied().unwrap_or(0),
            1 | 2 => self.lower.get(s).map_or(0, |m| m[tier - 1]),
            _ => self.external.get(s).copied().unwrap_or(0),
        }
    }

    /// Set `bit` at position `s` on the tier; false when it was set already.
    fn add(&mut self, tier: usize, s: u64, bit: u64) -> bool {
        let m = match tier {
            0 => self.device.entry(s),
            1 | 2 => &mut self.lower.entry(s)[tier - 1],
            _ => self.external.entry(s),
        };
        let new = *m & bit == 0;
        *m |= bit;
        new
    }

    /// Clear `bit` from position `s` on the tier, dropping the entry when it holds no
    /// slot any more.
    fn clear(&mut self, tier: usize, s: u64, bit: u64) {
        match tier {
            0 => clear_bit(&mut self.device, bit, s),
            1 | 2 => {
                if let Some(m) = self.lower.get_mut(&s) {
                    m[tier - 1] &= !bit;
                    if *m == [0, 0] {
                        self.lower.remove(&s);
                    }
                }
            }
            _ => clear_bit(&mut self.external, bit, s),
        }
    }

    fn prefetch(&self, tier: usize, s: &u64) {
        match tier {
            0 => self.device.prefetch(s),
            1 | 2 => self.lower.prefetch(s),
            _ => self.external.prefetch(s),
        }
    }

    fn heap_bytes(&self) -> usize {
        self.device.heap_bytes() + self.lower.heap_bytes() + self.external.heap_bytes()
    }
}

/// Clear `bit` from position `s`, dropping the entry when no slot is left.
fn clear_bit(owners: &mut Table<u64>, bit: u64, s: u64) {
    if let Some(m) = owners.get_mut(&s) {
        *m &= !bit;
        if *m == 0 {
            owners.remove(&s);
        }
    }
}

/// Release one identity of `slot` at position `s` on the tier.
fn release(owners: &mut Owners, tier: usize, aliases: &mut Map<u64, Map<u64, u32>>, slot: usize, bit: u64, s: u64) {
    if let Some(al) = aliases.get_mut(&(slot as u64)) {
        if let Some(extra) = al.get_mut(&s) {
            if *extra == 1 {
                al.remove(&s);
                if al.is_empty() {
                    aliases.remove(&(slot as u64));
                }
            } else {
                *extra -= 1;
            }
            return;
        }
    }
    owners.clear(tier, s, bit);
}

impl Tier {
    fn ensure(&mut self, slot: usize) {
        if self.blocks.len() <= slot {
            self.blocks.resize_with(slot + 1, Table::default);
        }
    }

    /// `tier`: this tier's index; `owners`: the slot's group's.
    #[allow(clippy::too_many_arguments)]
    fn store(
        &mut self,
        tier: usize,
        owners: &mut Owners,
        expect: &mut Expect,
        slot: usize,
        parent: Option<u64>,
        hashes: &[u64],
        tokens: &[u64],
    ) -> u8 {
        let n = hashes.len();
        if n == 0 || n != tokens.len() {
            return INVALID;
        }
        // A store that repeats its own hashes or its parent is invalid.
        if let Some(p) = parent {
            if hashes.contains(&p) {
                return INVALID;
            }
        }
        if n > 1 {
            let mut sorted = hashes.to_vec();
            sorted.sort_unstable();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return INVALID;
            }
        }
        self.ensure(slot);
        let parent_seq = match parent {
            None => None,
            Some(p) => match self.blocks[slot].get(&p) {
                Some(&s) => Some(s),
                None => return PARENT_NOT_FOUND,
            },
        };
        let seqs = sequence_of(tokens, parent_seq);
        let bit = 1u64 << (slot % 64);
        let blocks = &mut self.blocks[slot];
        let aliases = &mut self.aliases;
        // The blocks land at random slots of both tables: start loading every slot the
        // event touches, so that their cache misses overlap instead of following one
        // another. (Not growing the tables first: that would change the sizes they go
        // through, and reserving ahead was no faster, only less full.)
        for (bh, s) in hashes.iter().zip(&seqs) {
            blocks.prefetch(bh);
            owners.prefetch(tier, s);
        }
        for (&bh, &s) in hashes.iter().zip(&seqs) {
            expect.drop_position(slot, s); // confirmed: the index holds it now
            if let Some(old) = blocks.insert(bh, s) {
                if old == s {
                    continue; // stored again at the same position: nothing changes
                }
                release(owners, tier, aliases, slot, bit, old); // the identity moved
            }
            if !owners.add(tier, s, bit) {
                *aliases.entry(slot as u64).or_default().entry(s).or_insert(0) += 1;
            }
        }
        STORED
    }

    /// `owners`: every group's (the slot's holds its blocks when it has any).
    fn remove(&mut self, tier: usize, owners: &mut [Owners], slot: usize, hashes: &[u64]) -> usize {
        if slot >= self.blocks.len() || self.blocks[slot].is_empty() {
            return hashes.len();
        }
        let bit = 1u64 << (slot % 64);
        let blocks = &mut self.blocks[slot];
        let owners = &mut owners[slot / 64];
        // As in `store`: the misses of an event's blocks overlap, first in the reverse
        // table, then in the owners table once the positions are known.
        for bh in hashes {
            blocks.prefetch(bh);
        }
        let seqs: Vec<u64> = hashes.iter().filter_map(|bh| blocks.remove(bh)).collect();
        for s in &seqs {
            owners.prefetch(tier, s);
        }
        for &s in &seqs {
            release(owners, tier, &mut self.aliases, slot, bit, s);
        }
        if blocks.is_empty() {
            *blocks = Table::default(); // give the memory back
        }
        hashes.len() - seqs.len()
    }

    fn drop_slot(&mut self, tier: usize, owners: &mut [Owners], slot: usize) {
        if slot >= self.blocks.len() {
            return;
        }
        let bit = 1u64 << (slot % 64);
        let blocks = std::mem::take(&mut self.blocks[slot]);
        self.aliases.remove(&(slot as u64));
        if let Some(owners) = owners.get_mut(slot / 64) {
            for s in blocks.values() {
                owners.clear(tier, s, bit);
            }
        }
    }

    /// The owners entries of a group on this tier, and its slots' aliases, from the
    /// slots' reverse tables (a restore installed them whole): every (position, slot)
    /// sorted once, each position's slots ORed, a slot's repeats counted as aliases.
    /// Mixed positions, ascending.
    fn held_masks(&mut self, group: usize) -> Vec<(u64, u64)> {
        let slots = group * 64..self.blocks.len().min(group * 64 + 64);
        let total = slots.clone().map(|slot| self.blocks[slot].len()).sum();
        let mut held: Vec<(u64, u8)> = Vec::with_capacity(total);
        for slot in slots.clone() {
            self.aliases.remove(&(slot as u64));
            held.extend(self.blocks[slot].values().map(|s| (mix(s), (slot % 64) as u8)));
        }
        let held = sorted(held);
        let mut owners: Vec<(u64, u64)> = Vec::with_capacity(held.len());
        for &(z, b) in &held {
            let bit = 1u64 << b;
            match owners.last_mut() {
                Some((last, mask)) if *last == z => {
                    if *mask & bit != 0 {
                        let slot = (group * 64 + b as usize) as u64;
                        *self.aliases.entry(slot).or_default().entry(unmix(z)).or_insert(0) += 1;
                    }
                    *mask |= bit;
                }
                _ => owners.push((z, bit)),
            }
        }
        owners
    }

    fn size(&self, slot: usize) -> usize {
        self.blocks.get(slot).map_or(0, |b| b.len())
    }
}

/// `held` in ascending order: spread over buckets by their top bits in one pass, then
/// each bucket sorted while it is in cache (faster than one sort of a 10 M-block
/// restore's positions; 1,024 buckets, as more of them thrash the TLB when spreading).
fn sorted(held: Vec<(u64, u8)>) -> Vec<(u64, u8)> {
    const BITS: u32 = 10;
    if held.len() < 1 << BITS {
        let mut held = held;
        held.sort_unstable();
        return held;
    }
    let bucket = |z: u64| (z >> (64 - BITS)) as usize;
    let mut starts = vec![0usize; (1 << BITS) + 1];
    for &(z, _) in &held {
        starts[bucket(z) + 1] += 1;
    }
    for i in 1..starts.len() {
        starts[i] += starts[i - 1];
    }
    let mut next = starts.clone();
    let mut out = vec![(0u64, 0u8); held.len()];
    for e in held {
        let b = bucket(e.0);
        out[next[b]] = e;
        next[b] += 1;
    }
    for w in starts.windows(2) {
        out[w[0]..w[1]].sort_unstable();
    }
    out
}

/// `count` little-endian u64 at byte `at` of `data`.
fn packed_words(data: &[u8], at: usize, count: usize) -> PyResult<Vec<u64>> {
    let end = count.checked_mul(8).and_then(|len| len.checked_add(at));
    match end {
        Some(end) if end <= data.len() => Ok(data[at..end]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
            .collect()),
        _ => Err(PyValueError::new_err(format!(
            "{count} packed hashes at byte {at} overrun {} bytes",
            data.len()
        ))),
    }
}

/// hashbrown's footprint of a table: one control byte per bucket plus the entry;
/// buckets ≈ capacity·8/7.
fn map_bytes(cap: usize, entry: usize) -> usize {
    cap * 8 / 7 * (entry + 1)
}

/// One worker's reverse tables per (rank, tier index), as a snapshot blob holds them
/// (kvstream/replica/snapshot.py): checked when read, so that a damaged blob is refused
/// before anything is installed, then moved into an index by `IndexCore.install`.
/// Blob layout, little-endian: parts (u32), then per part its rank (u32), tier (u8),
/// capacity (u64), whether block hash 0 is held (u8) and its position (u64), then per
/// slot its mixed key and position (table.rs's raw array).
#[pyclass(module = "kvstream._native")]
pub struct WorkerTables {
    parts: Vec<(u32, usize, Table<u64>)>,
    /// Installed: the tables were moved into an index.
    taken: bool,
}

/// Reads a blob front to back; every read says what it was for when the blob is short.
struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], String> {
        match self.at.checked_add(n) {
            Some(end) if end <= self.data.len() => {
                let out = &self.data[self.at..end];
                self.at = end;
                Ok(out)
            }
            _ => Err(format!("the blob ends inside {what} (byte {} of {})", self.at, self.data.len())),
        }
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }

    /// `n` (u64, u64) pairs.
    fn pairs(&mut self, n: u64, what: &str) -> Result<Vec<(u64, u64)>, String> {
        let bytes = usize::try_from(n).ok().and_then(|n| n.checked_mul(16)).ok_or_else(|| format!("{what}: {n} slots"))?;
        let word = |c: &[u8]| u64::from_le_bytes(c.try_into().expect("8 bytes"));
        Ok(self.take(bytes, what)?.chunks_exact(16).map(|c| (word(&c[..8]), word(&c[8..]))).collect())
    }
}

impl WorkerTables {
    fn read(data: &[u8], start: usize) -> Result<Self, String> {
        let mut r = Reader { data, at: start };
        let count = u32::from_le_bytes(r.take(4, "the part count")?.try_into().expect("4 bytes"));
        let mut parts = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for i in 0..count {
            let head = r.take(5, "a part's header")?;
            let rank = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
            let tier = usize::from(head[4]);
            if tier >= TIERS {
                return Err(format!("part {i}: tier index {tier} out of range"));
            }
            if !seen.insert((rank, tier)) {
                return Err(format!("part {i}: rank {rank} tier {tier} appears twice"));
            }
            let cap = r.u64("a part's header")?;
            let zero = match r.take(1, "a part's header")?[0] {
                0 => None,
                1 => Some(0),
                b => return Err(format!("part {i}: zero-key flag {b} is neither 0 nor 1")),
            };
            let zero_value = r.u64("a part's header")?;
            let slots = r.pairs(cap, "a table's slots")?;
            let table = Table::from_raw(slots, zero.map(|_| zero_value))
                .map_err(|e| format!("rank {rank} tier {tier}: not a valid table: {e}"))?;
            parts.push((rank, tier, table));
        }
        if r.at != data.len() {
            return Err(format!("{} bytes after the last part", data.len() - r.at));
        }
        Ok(WorkerTables { parts, taken: false })
    }

    fn check_untaken(&self) -> PyResult<()> {
        if self.taken {
            return Err(PyValueError::new_err("these tables were installed already"));
        }
        Ok(())
    }
}

#[pymethods]
impl WorkerTables {
    /// The tables of a blob from byte `start` on; ValueError saying what is wrong with
    /// a damaged one.
    #[staticmethod]
    #[pyo3(signature = (data, start=0))]
    fn parse(data: &[u8], start: usize) -> PyResult<Self> {
        if start > data.len() {
            return Err(PyValueError::new_err(format!("start {start} is past the blob's {} bytes", data.len())));
        }
        WorkerTables::read(data, start).map_err(PyValueError::new_err)
    }

    /// Tables of (rank, tier index, block hashes, positions) parts, built by insertion;
    /// ValueError when a part's lists differ in length or a block hash repeats.
    #[staticmethod]
    fn from_lists(parts: Vec<(u32, usize, Vec<u64>, Vec<u64>)>) -> PyResult<Self> {
        let mut out = Vec::with_capacity(parts.len());
        for (rank, tier, hashes, seqs) in parts {
            check_tier(tier)?;
            if hashes.len() != seqs.len() {
                return Err(PyValueError::new_err(format!("{} block hashes but {} sequence hashes", hashes.len(), seqs.len())));
            }
            let mut table = Table::default();
            table.reserve(hashes.len());
            for (&h, &s) in hashes.iter().zip(&seqs) {
                if table.insert(h, s).is_some() {
                    return Err(PyValueError::new_err("exported block hashes repeat"));
                }
            }
            out.push((rank, tier, table));
        }
        Ok(WorkerTables { parts: out, taken: false })
    }

    /// (rank, tier index) of each part, in order.
    fn keys(&self) -> PyResult<Vec<(u32, usize)>> {
        self.check_untaken()?;
        Ok(self.parts.iter().map(|(r, t, _)| (*r, *t)).collect())
    }

    /// Per part: (rank, tier index, block hashes, positions), aligned.
    #[allow(clippy::type_complexity)]
    fn lists(&self) -> PyResult<Vec<(u32, usize, Vec<u64>, Vec<u64>)>> {
        self.check_untaken()?;
        Ok(self
            .parts
            .iter()
            .map(|(r, t, table)| {
                let (h, s): (Vec<u64>, Vec<u64>) = table.iter().unzip();
                (*r, *t, h, s)
            })
            .collect())
    }
}

/// Every tier of every worker slot. Slots are small ints assigned by the Python side.
#[pyclass(module = "kvstream._native")]
pub struct IndexCore {
    tiers: [Tier; TIERS],
    /// Per group of 64 slots: its owners tables.
    owners: Vec<Owners>,
    /// Per group of 64 slots: the slots in use.
    known: Vec<u64>,
    /// Blocks expected on slots because requests were routed there (expect.rs).
    pub(crate) expect: Expect,
}

fn check_ttl(ttl: f64) -> PyResult<()> {
    if !(ttl > 0.0 && ttl.is_finite()) {
        return Err(PyValueError::new_err(format!("expected_ttl_s must be a finite number > 0, got {ttl}")));
    }
    Ok(())
}

fn check_tier(tier: usize) -> PyResult<()> {
    if tier >= TIERS {
        return Err(PyValueError::new_err(format!("tier index {tier} out of range")));
    }
    Ok(())
}

impl IndexCore {
    /// How many leading positions of `seqs` matching credits to the slot on its tiers
    /// (the walk's rule for one slot: the device prefix, continued on each lower tier in
    /// turn).
    pub(crate) fn held_prefix(&self, slot: usize, seqs: &[u64]) -> usize {
        let bit = 1u64 << (slot % 64);
        let held = |t: usize, s: &u64| self.owners.get(slot / 64).is_some_and(|o| o.get(t, s) & bit != 0);
        let mut t = 0;
        for (i, s) in seqs.iter().enumerate() {
            while t < TIERS && !held(t, s) {
                t += 1;
            }
            if t == TIERS {
                return i;
            }
        }
        seqs.len()
    }

    fn ensure_group(&mut self, group: usize) {
        if self.owners.len() <= group {
            self.owners.resize_with(group + 1, Owners::default);
        }
    }

    /// Rebuild a group's owners of the tier from its slots' reverse tables (both of
    /// host_pinned and disk, which share a table).
    fn rebuild_owners(&mut self, tier: usize, group: usize) {
        self.ensure_group(group);
        let owners = &mut self.owners[group];
        match tier {
            0 => owners.device = Table::from_sorted(&self.tiers[0].held_masks(group)),
            1 | 2 => {
                let host = self.tiers[1].held_masks(group);
                let disk = self.tiers[2].held_masks(group);
                let mut both = Vec::with_capacity(host.len().max(disk.len()));
                let (mut h, mut d) = (host.iter().peekable(), disk.iter().peekable());
                loop {
                    let next = match (h.peek(), d.peek()) {
                        (None, None) => break,
                        (Some(&&(zh, mh)), Some(&&(zd, md))) if zh == zd => {
                            h.next();
                            d.next();
                            (zh, [mh, md])
                        }
                        (Some(&&(zh, mh)), Some(&&(zd, _))) if zh < zd => {
                            h.next();
                            (zh, [mh, 0])
                        }
                        (Some(&&(zh, mh)), None) => {
                            h.next();
                            (zh, [mh, 0])
                        }
                        (_, Some(&&(zd, md))) => {
                            d.next();
                            (zd, [0, md])
                        }
                    };
                    both.push(next);
                }
                owners.lower = Table::from_sorted(&both);
            }
            _ => owners.external = Table::from_sorted(&self.tiers[3].held_masks(group)),
        }
    }
}

#[pymethods]
impl IndexCore {
    /// `expected_ttl_s`: how long a prediction lives unconfirmed; `expected_cap`: most
    /// expected positions per slot unless `set_expected_cap` says otherwise.
    #[new]
    #[pyo3(signature = (expected_ttl_s=120.0, expected_cap=65_536))]
    fn new(expected_ttl_s: f64, expected_cap: usize) -> PyResult<Self> {
        check_ttl(expected_ttl_s)?;
        Ok(IndexCore { tiers: Default::default(), owners: Vec::new(), known: Vec::new(), expect: Expect::new(expected_ttl_s, expected_cap) })
    }

    /// Mark a slot in use (a candidate for matching).
    fn add_slot(&mut self, slot: usize) {
        let group = slot / 64;
        if self.known.len() <= group {
            self.known.resize(group + 1, 0);
        }
        self.known[group] |= 1u64 << (slot % 64);
        for tier in &mut self.tiers {
            tier.ensure(slot);
        }
        self.ensure_group(group);
    }

    /// Forget every block and expectation of the slot and free it: O(its blocks).
    fn remove_slot(&mut self, slot: usize) {
        self.clear_slot(slot);
        if let Some(k) = self.known.get_mut(slot / 64) {
            *k &= !(1u64 << (slot % 64));
        }
    }

    /// Forget every block of the slot on every tier, and what it was expected to store
    /// (an engine that restarted holds nothing); it stays in use.
    fn clear_slot(&mut self, slot: usize) {
        self.drop_blocks(slot);
        self.expect.clear(slot);
    }

    /// Forget every block of the slot on every tier, not its expectations (the worker's
    /// events stopped: what routing predicts of it is the load log's, not the events'); it
    /// stays in use.
    fn drop_blocks(&mut self, slot: usize) {
        for (t, tier) in self.tiers.iter_mut().enumerate() {
            tier.drop_slot(t, &mut self.owners, slot);
        }
    }

    /// The slot's events stopped (its lease ran out): what the index last knew it held on
    /// the device becomes expected there as of `at` (log time), like blocks routed there,
    /// and its blocks are forgotten. (In hash order: equal stamps are trimmed by it.)
    fn demote(&mut self, slot: usize, at: f64) {
        let mut seqs: Vec<u64> = self.tiers[0].blocks.get(slot).map(|b| b.values().collect()).unwrap_or_default();
        seqs.sort_unstable();
        seqs.dedup();
        self.drop_blocks(slot);
        self.expect.add(slot, &seqs, 0, at);
    }

    /// Forget every block of the slot on one tier; it stays in use: O(its blocks there).
    /// A device reset also drops what the slot was expected to compute there.
    fn clear_tier(&mut self, tier: usize, slot: usize) -> PyResult<()> {
        check_tier(tier)?;
        if tier == 0 {
            self.expect.clear(slot);
        }
        self.tiers[tier].drop_slot(tier, &mut self.owners, slot);
        Ok(())
    }

    /// Expect the prompt positions `sequence_hashes` (a list of ints or little-endian u64
    /// bytes) on the slot, as routed at `routed_at` (expect.rs): those past its held
    /// prefix, whose length is `held` when the caller knows it (a decision's overlap),
    /// else found here.
    #[pyo3(signature = (slot, sequence_hashes, routed_at, held=None))]
    fn expect(&mut self, slot: usize, sequence_hashes: &Bound<'_, PyAny>, routed_at: f64, held: Option<usize>) -> PyResult<()> {
        let seqs = crate::route::hashes_from(sequence_hashes)?;
        self.add_slot(slot);
        let held = held.unwrap_or_else(|| self.held_prefix(slot, &seqs));
        self.expect.add(slot, &seqs, held, routed_at);
        Ok(())
    }

    /// Stop expecting these positions on the slot (the request that predicted them
    /// failed before its prompt was computed).
    fn unexpect(&mut self, slot: usize, sequence_hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        for pos in crate::route::hashes_from(sequence_hashes)? {
            self.expect.drop_position(slot, pos);
        }
        Ok(())
    }

    /// Drop the expectations routed more than their TTL before `now`.
    fn expire_expected(&mut self, now: f64) {
        self.expect.expire(now);
    }

    /// The most positions the slot may be expected to hold (its engine's device
    /// capacity, when known); None: the default.
    #[pyo3(signature = (slot, cap=None))]
    fn set_expected_cap(&mut self, slot: usize, cap: Option<usize>) {
        self.expect.set_cap(slot, cap);
    }

    fn set_expected_limits(&mut self, ttl_s: f64, default_cap: usize) -> PyResult<()> {
        check_ttl(ttl_s)?;
        self.expect.set_ttl(ttl_s);
        self.expect.set_default_cap(default_cap);
        Ok(())
    }

    /// Positions expected on the slot.
    fn expected_count(&self, slot: usize) -> usize {
        self.expect.count(slot)
    }

    /// Positions expected over every slot.
    fn expected_total(&self) -> usize {
        self.expect.len()
    }

    /// Apply a stored event: 0 stored, 1 invalid (repeats its hashes or its parent),
    /// 2 parent not held by the slot on this tier. Nothing is applied unless 0.
    #[pyo3(signature = (tier, slot, parent, block_hashes, tokens_hashes))]
    fn store(
        &mut self,
        tier: usize,
        slot: usize,
        parent: Option<u64>,
        block_hashes: Vec<u64>,
        tokens_hashes: Vec<u64>,
    ) -> PyResult<u8> {
        check_tier(tier)?;
        self.ensure_group(slot / 64);
        Ok(self.tiers[tier].store(tier, &mut self.owners[slot / 64], &mut self.expect, slot, parent, &block_hashes, &tokens_hashes))
    }

    /// Apply a removed event; returns how many block hashes were not held (skipped).
    fn remove(&mut self, tier: usize, slot: usize, block_hashes: Vec<u64>) -> PyResult<usize> {
        check_tier(tier)?;
        Ok(self.tiers[tier].remove(tier, &mut self.owners, slot, &block_hashes))
    }

    /// `store` with the hashes still packed in a message (kvstream/events/codec.py's
    /// reader gives the offsets): `count` little-endian u64 block hashes at byte
    /// `blocks_at` of `data`, and as many tokens hashes at `tokens_at`.
    #[pyo3(signature = (tier, slot, parent, data, blocks_at, tokens_at, count))]
    #[allow(clippy::too_many_arguments)]
    fn store_packed(
        &mut self,
        tier: usize,
        slot: usize,
        parent: Option<u64>,
        data: &[u8],
        blocks_at: usize,
        tokens_at: usize,
        count: usize,
    ) -> PyResult<u8> {
        check_tier(tier)?;
        let (hashes, tokens) = (packed_words(data, blocks_at, count)?, packed_words(data, tokens_at, count)?);
        self.ensure_group(slot / 64);
        Ok(self.tiers[tier].store(tier, &mut self.owners[slot / 64], &mut self.expect, slot, parent, &hashes, &tokens))
    }

    /// `remove` with the hashes still packed in a message (see `store_packed`).
    fn remove_packed(&mut self, tier: usize, slot: usize, data: &[u8], at: usize, count: usize) -> PyResult<usize> {
        check_tier(tier)?;
        let hashes = packed_words(data, at, count)?;
        Ok(self.tiers[tier].remove(tier, &mut self.owners, slot, &hashes))
    }

    /// Blocks the slot holds over every tier.
    fn slot_size(&self, slot: usize) -> usize {
        self.tiers.iter().map(|t| t.size(slot)).sum()
    }

    fn size(&self, tier: usize, slot: usize) -> PyResult<usize> {
        check_tier(tier)?;
        Ok(self.tiers[tier].size(slot))
    }

    /// The slot's (block hashes, sequence hashes) on a tier, aligned (for snapshots).
    fn export(&self, tier: usize, slot: usize) -> PyResult<(Vec<u64>, Vec<u64>)> {
        check_tier(tier)?;
        Ok(self.tiers[tier]
            .blocks
            .get(slot)
            .map(|b| b.iter().unzip())
            .unwrap_or_default())
    }

    /// A worker's snapshot blob body (`WorkerTables`' layout): the raw reverse table of
    /// each (rank, tier index, slot) part, in the order given.
    fn export_tables<'py>(&self, py: Python<'py>, parts: Vec<(u32, usize, usize)>) -> PyResult<Bound<'py, PyBytes>> {
        let mut out = Vec::new();
        out.extend_from_slice(&u32::try_from(parts.len()).map_err(|_| PyValueError::new_err("too many parts"))?.to_le_bytes());
        let none = Table::default();
        for (rank, tier, slot) in parts {
            check_tier(tier)?;
            let (slots, zero) = self.tiers[tier].blocks.get(slot).unwrap_or(&none).raw();
            out.extend_from_slice(&rank.to_le_bytes());
            out.push(tier as u8);
            out.extend_from_slice(&(slots.len() as u64).to_le_bytes());
            out.push(u8::from(zero.is_some()));
            out.extend_from_slice(&zero.unwrap_or(0).to_le_bytes());
            out.reserve(slots.len() * 16);
            for &(k, v) in slots {
                out.extend_from_slice(&k.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Ok(PyBytes::new(py, &out))
    }

    /// Install workers' tables, each part at the slot given for it (in `keys()` order),
    /// then build the owners tables of the groups they join. Every check comes first
    /// (the slots hold nothing on those tiers, no slot twice, no tables installed
    /// already): on error nothing is installed.
    fn install(&mut self, workers: Vec<(PyRefMut<'_, WorkerTables>, Vec<usize>)>) -> PyResult<()> {
        let mut taken = std::collections::HashSet::new();
        for (tables, slots) in &workers {
            tables.check_untaken()?;
            if slots.len() != tables.parts.len() {
                return Err(PyValueError::new_err(format!("{} slots for {} parts", slots.len(), tables.parts.len())));
            }
            for (&slot, (_, tier, _)) in slots.iter().zip(&tables.parts) {
                if self.tiers[*tier].size(slot) > 0 || !taken.insert((slot, *tier)) {
                    return Err(PyValueError::new_err(format!("slot {slot} already holds blocks on tier {tier}")));
                }
            }
        }
        let mut groups = std::collections::BTreeSet::new();
        for (mut tables, slots) in workers {
            tables.taken = true;
            for (slot, (_, tier, table)) in slots.into_iter().zip(std::mem::take(&mut tables.parts)) {
                if self.expect.count(slot) > 0 {
                    for s in table.values() {
                        self.expect.drop_position(slot, s); // confirmed: held now
                    }
                }
                self.tiers[tier].ensure(slot);
                self.tiers[tier].blocks[slot] = table;
                // host_pinned and disk share a table: one rebuild for both.
                groups.insert((if tier == 2 { 1 } else { tier }, slot / 64));
            }
        }
        for (tier, group) in groups {
            self.rebuild_owners(tier, group);
        }
        Ok(())
    }

    /// Approximate bytes held by the hash tables (the expectations' included).
    fn heap_bytes(&self) -> usize {
        let tiers: usize = self
            .tiers
            .iter()
            .map(|t| {
                t.blocks.iter().map(Table::heap_bytes).sum::<usize>()
                    + t.blocks.capacity() * std::mem::size_of::<Table<u64>>()
                    + t.aliases.values().map(|m| map_bytes(m.capacity(), 12)).sum::<usize>()
            })
            .sum();
        let owners = self.owners.iter().map(Owners::heap_bytes).sum::<usize>()
            + self.owners.capacity() * std::mem::size_of::<Owners>();
        tiers + owners + self.expect.heap_bytes()
    }

    /// Per slot with any match: (slot, (device, host_pinned, disk, external)) block counts
    /// for a prompt given by its sequence hashes (`chained`) or its local hashes (a list
    /// of ints; the sequence hashes are then chained here, only as far as the walk goes).
    /// Each slot extends its
    /// prefix on the device tier, then continues on the next tiers in order from where it
    /// stopped (starting on a lower tier at block 0 when it has no device match); a
    /// block is credited once. All slots of a group advance together, one position (one
    /// lookup) at a time, and the walk stops as soon as none extends, so the prompt's
    /// hashes are read from the list only as far as some worker matches.
    #[allow(clippy::type_complexity)]
    fn find_matches(&self, hashes: &Bound<'_, PyList>, chained: bool) -> PyResult<Vec<(usize, (u32, u32, u32, u32, u32))>> {
        let mut seqs: Vec<u64> = Vec::with_capacity(hashes.len());
        let mut fill = |seqs: &mut Vec<u64>, end: usize| -> PyResult<()> {
            while seqs.len() < end {
                let h = u64_at(hashes, seqs.len())?;
                seqs.push(match seqs.last() {
                    Some(&prev) if !chained => chain(prev, h),
                    _ => h, // a sequence hash, or the first block (seq = local)
                });
            }
            Ok(())
        };
        let found = self.walk(hashes.len(), &mut seqs, &mut fill)?;
        Ok(found.into_iter().map(|(s, c)| (s, (c[0], c[1], c[2], c[3], c[4]))).collect())
    }
}

impl IndexCore {
    /// Per slot with any match, its per-tier counts for the prompt whose `n` sequence
    /// hashes `fill(seqs, end)` appends to `seqs` up to `end` (lazily, as far as the walk
    /// goes; kvstream/_native_src/src/route.rs passes them all at once).
    pub(crate) fn walk(
        &self,
        n: usize,
        seqs: &mut Vec<u64>,
        fill: &mut dyn FnMut(&mut Vec<u64>, usize) -> PyResult<()>,
    ) -> PyResult<Vec<(usize, [u32; COLS])>> {
        let mut out = Vec::new();
        for (group, &known) in self.known.iter().enumerate() {
            if known == 0 || n == 0 {
                continue;
            }
            // The group's owners tables (empty ones cost no lookup).
            let Some(owners) = self.owners.get(group) else { continue };
            let device = Some(&owners.device).filter(|o| !o.is_empty());
            let lower = Some(&owners.lower).filter(|o| !o.is_empty());
            let external = Some(&owners.external).filter(|o| !o.is_empty());
            let expected = self.expect.group_masks(group);
            // on[t]: slots extending their prefix on tier t through the previous position.
            let mut on = [known, 0, 0, 0, 0];
            let mut start = [0u32; 64];
            let mut counts = [[0u32; COLS]; 64];
            let mut matched = 0u64;
            let mut i = 0usize;
            // Per position: the device mask and the expected one (the lower tiers' are
            // looked up only where a slot is on that tier or moving to it).
            let mut batch: Vec<[u64; 2]> = Vec::with_capacity(LOOKAHEAD);
            let mut batch_start = 0usize;
            while i < n {
                if i == batch_start + batch.len() {
                    // Look up the next positions together: the loads are independent, so
                    // their cache misses overlap instead of following one another.
                    let end = (i + LOOKAHEAD).min(n);
                    fill(seqs, end)?;
                    batch.clear();
                    for s in &seqs[i..end] {
                        device.inspect(|o| o.prefetch(s));
                        lower.inspect(|o| o.prefetch(s));
                    }
                    batch.extend(seqs[i..end].iter().map(|s| {
                        let d = device.and_then(|o| o.get(s).copied()).unwrap_or(0);
                        let e = expected.and_then(|x| x.get(s).copied()).unwrap_or(0);
                        [d, e]
                    }));
                    batch_start = i;
                }
                let [device_here, expected_here] = batch[i - batch_start];
                let mut moving = 0u64; // slots that stopped on the previous tier here
                let mut alive = 0u64;
                let mut lower_here: Option<[u64; 2]> = None; // host_pinned, disk
                for t in 0..COLS {
                    let m = on[t] | moving;
                    let mask = match t {
                        0 => device_here,
                        TIERS => expected_here,
                        _ if m == 0 => 0,
                        1 | 2 => {
                            let both = *lower_here
                                .get_or_insert_with(|| lower.and_then(|o| o.get(&seqs[i]).copied()).unwrap_or([0, 0]));
                            both[t - 1]
                        }
                        _ => external.and_then(|o| o.get(&seqs[i]).copied()).unwrap_or(0),
                    };
                    let held = mask & m;
                    let mut stopped = on[t] & !held;
                    while stopped != 0 {
                        let b = stopped.trailing_zeros() as usize;
                        stopped &= stopped - 1;
                        counts[b][t] = i as u32 - start[b];
                    }
                    let mut arrived = moving & held;
                    while arrived != 0 {
                        let b = arrived.trailing_zeros() as usize;
                        arrived &= arrived - 1;
                        start[b] = i as u32;
                    }
                    alive |= held;
                    on[t] = held;
                    moving = m & !held;
                }
                if alive == 0 {
                    break;
                }
                matched |= alive;
                i += 1;
            }
            for t in 0..COLS {
                let mut still = on[t];
                while still != 0 {
                    let b = still.trailing_zeros() as usize;
                    still &= still - 1;
                    counts[b][t] = i as u32 - start[b];
                }
            }
            while matched != 0 {
                let b = matched.trailing_zeros() as usize;
                matched &= matched - 1;
                let c = counts[b];
                out.push((group * 64 + b, c));
            }
        }
        Ok(out)
    }
}
