//! The index's maps (index.rs: per slot, block hash → position; per group of slots,
//! position → slots' bitmask): u64 keys (hashes, small engine ids) to small `Copy`
//! values, Robin Hood open addressing with backward-shift deletion.
//!
//! Why not std's HashMap: its bucket count is a power of two, so a table sits anywhere
//! between 44 % and 87 % full, and these maps (one per worker slot and tier, a block
//! each) were half of the 1 M-block index's ~50 bytes of RSS per block. Here a key's
//! home slot is `mixed key · capacity >> 64` for any capacity, so a table grows by half
//! and stays 60–90 % full. Robin Hood keeps probe runs short at that fill: a lookup
//! stops as soon as it passes where its key would have been placed. (Growing by a
//! quarter kept tables fuller but made applying events ~2× slower, all in rehashing.)
//!
//! Since a home depends only on the key and the capacity, the raw slots are valid
//! wherever they are copied at the same capacity: snapshots store them as they are
//! (`raw`, checked back by `from_raw`), and a table is built from keys sorted in home
//! order by laying them out in one pass (`from_sorted`).
use std::mem;

/// Grow when more than 9/10 full; by half.
const MAX_FILL_NUM: usize = 9;
const MAX_FILL_DEN: usize = 10;
const MIN_CAPACITY: usize = 8;
/// Longest run of entries of one home that `from_raw` accepts (its duplicate check is
/// quadratic in a run; mixed keys make runs of more than a few entries vanishingly rare).
const MAX_RUN: usize = 1024;
/// Stored key of an empty slot; the entry of key 0 (mixed: 0) is kept aside.
const EMPTY: u64 = 0;

/// splitmix64's finalizer (engine block ids may be small consecutive ints). A
/// bijection: the table stores keys mixed, so that a slot's home is known without
/// mixing again while probing, and `unmix` gives the key back.
#[inline]
pub(crate) fn mix(k: u64) -> u64 {
    let mut z = k;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub(crate) fn unmix(z: u64) -> u64 {
    let mut z = z ^ (z >> 31) ^ (z >> 62);
    z = z.wrapping_mul(0x3196_42b2_d24d_8ec3);
    z = z ^ (z >> 27) ^ (z >> 54);
    z = z.wrapping_mul(0x96de_1b17_3f11_9089);
    z ^ (z >> 30) ^ (z >> 60)
}

pub(crate) struct Table<V: Copy + Default> {
    /// (mixed key, value) per slot: a lookup's value is on its key's cache line (the
    /// owners tables, looked up per prompt position, took a second miss for it when
    /// keys and values were two arrays).
    slots: Vec<(u64, V)>,
    /// Entries in the slots (not counting `zero`).
    len: usize,
    zero: Option<V>,
}

impl<V: Copy + Default> Default for Table<V> {
    fn default() -> Self {
        Table { slots: Vec::new(), len: 0, zero: None }
    }
}

impl<V: Copy + Default> Table<V> {
    /// Home slot of a mixed key.
    #[inline]
    fn home(&self, z: u64) -> usize {
        ((u128::from(z) * self.slots.len() as u128) >> 64) as usize
    }

    /// How far the entry at `i` sits from its home.
    #[inline]
    fn distance(&self, i: usize) -> usize {
        let h = self.home(self.slots[i].0);
        if i >= h {
            i - h
        } else {
            i + self.slots.len() - h
        }
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// Probe for mixed key `z` (not 0; the slots not empty): `Ok(slot)` where it is, or
    /// `Err((slot, distance))` where the probe stopped, which is where it would go (Robin
    /// Hood: the key would sit no further from its home than that).
    #[inline]
    fn probe(&self, z: u64) -> Result<usize, (usize, usize)> {
        let mut i = self.home(z);
        let mut d = 0;
        loop {
            let k = self.slots[i].0;
            if k == z {
                return Ok(i);
            }
            if k == EMPTY || self.distance(i) < d {
                return Err((i, d));
            }
            i = self.next(i);
            d += 1;
        }
    }

    /// The slot of mixed key `z` (not 0).
    #[inline]
    fn find(&self, z: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        self.probe(z).ok()
    }

    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots allocated.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Bytes of the slots (for the memory estimate).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.len() * mem::size_of::<(u64, V)>()
    }

    pub(crate) fn get(&self, key: &u64) -> Option<&V> {
        let z = mix(*key);
        if z == EMPTY {
            return self.zero.as_ref();
        }
        self.find(z).map(|i| &self.slots[i].1)
    }

    pub(crate) fn get_mut(&mut self, key: &u64) -> Option<&mut V> {
        let z = mix(*key);
        if z == EMPTY {
            return self.zero.as_mut();
        }
        self.find(z).map(|i| &mut self.slots[i].1)
    }

    /// The value of `key`, inserted as the default if absent.
    pub(crate) fn entry(&mut self, key: u64) -> &mut V {
        let z = mix(key);
        if z == EMPTY {
            return self.zero.get_or_insert_with(V::default);
        }
        self.reserve(1);
        let i = match self.probe(z) {
            Ok(i) => i,
            Err((i, d)) => {
                // place_from puts `z` at `i` itself and moves the rest on.
                self.place_from(i, d, z, V::default());
                i
            }
        };
        &mut self.slots[i].1
    }

    /// Start loading the home slot of `key` into the cache (a lookup soon after finds it
    /// there: the misses of several lookups overlap instead of following one another).
    #[inline]
    pub(crate) fn prefetch(&self, key: &u64) {
        #[cfg(target_arch = "x86_64")]
        if !self.slots.is_empty() {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let i = self.home(mix(*key));
            // SAFETY: i < slots.len(); a prefetch reads nothing.
            unsafe { _mm_prefetch(self.slots.as_ptr().add(i).cast::<i8>(), _MM_HINT_T0) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = key;
    }

    /// Room for `extra` more entries without growing on the way.
    pub(crate) fn reserve(&mut self, extra: usize) {
        let want = self.len + extra;
        if want * MAX_FILL_DEN > self.slots.len() * MAX_FILL_NUM {
            let fits = (want * MAX_FILL_DEN).div_ceil(MAX_FILL_NUM);
            self.resize(fits.max(self.slots.len() + self.slots.len() / 2).max(MIN_CAPACITY));
        }
    }

    fn resize(&mut self, capacity: usize) {
        let slots = mem::replace(&mut self.slots, vec![(EMPTY, V::default()); capacity]);
        self.len = 0;
        for (z, v) in slots {
            if z != EMPTY {
                self.place(z, v);
            }
        }
    }

    /// Put a new mixed key (not present, not 0) in; there is room.
    fn place(&mut self, z: u64, v: V) {
        self.place_from(self.home(z), 0, z, v);
    }

    /// Put `z` at slot `i`, `d` from its home, where a probe for it stopped; the entries
    /// from there shift on, each into the next slot nearer its home or empty.
    fn place_from(&mut self, mut i: usize, mut d: usize, mut z: u64, mut v: V) {
        loop {
            if self.slots[i].0 == EMPTY {
                self.slots[i] = (z, v);
                self.len += 1;
                return;
            }
            let here = self.distance(i);
            if here < d {
                // Take the slot of an entry nearer its home; carry that one on.
                (z, v) = mem::replace(&mut self.slots[i], (z, v));
                d = here;
            }
            i = self.next(i);
            d += 1;
        }
    }

    /// Set `key` to `value`; returns the previous value. One pass: the probe that
    /// misses the key is where it goes.
    pub(crate) fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let z = mix(key);
        if z == EMPTY {
            return self.zero.replace(value);
        }
        self.reserve(1);
        match self.probe(z) {
            Ok(i) => Some(mem::replace(&mut self.slots[i].1, value)),
            Err((i, d)) => {
                self.place_from(i, d, z, value);
                None
            }
        }
    }

    pub(crate) fn remove(&mut self, key: &u64) -> Option<V> {
        let z = mix(*key);
        if z == EMPTY {
            return self.zero.take();
        }
        let mut i = self.find(z)?;
        let value = self.slots[i].1;
        // Shift the run after it back by one, up to an empty slot or an entry at home.
        let mut j = self.next(i);
        while self.slots[j].0 != EMPTY && self.distance(j) > 0 {
            self.slots[i] = self.slots[j];
            i = j;
            j = self.next(j);
        }
        self.slots[i].0 = EMPTY;
        self.len -= 1;
        Some(value)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        self.zero.map(|v| (0, v)).into_iter().chain(
            self.slots.iter().filter(|&&(z, _)| z != EMPTY).map(|&(z, v)| (unmix(z), v)),
        )
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = V> + '_ {
        self.iter().map(|(_, v)| v)
    }

    /// The (mixed key, value) slots (empty ones: key 0) and the entry of key 0: all a
    /// copy needs.
    pub(crate) fn raw(&self) -> (&[(u64, V)], Option<V>) {
        (&self.slots, self.zero)
    }

    /// The table whose `raw` parts these are, or why they are not one: every entry must
    /// be where Robin Hood insertion leaves it (the first of a run at its home, homes
    /// non-decreasing along a run: what lookups rely on), no key twice, and at least the
    /// free slots that growing keeps. One pass, no insert.
    pub(crate) fn from_raw(slots: Vec<(u64, V)>, zero: Option<V>) -> Result<Self, String> {
        let mut t = Table { slots, len: 0, zero };
        let cap = t.slots.len();
        if cap == 0 {
            return Ok(t);
        }
        if cap < MIN_CAPACITY {
            return Err(format!("capacity {cap} is under the least a table has ({MIN_CAPACITY})"));
        }
        // Start after an empty slot, so that no run is cut in two by the wrap.
        let Some(start) = t.slots.iter().position(|&(k, _)| k == EMPTY) else {
            return Err("no empty slot".to_string());
        };
        let mut prev: Option<usize> = None; // distance of the entry before, in this run
        let mut run: Vec<u64> = Vec::new(); // keys of the current home
        let mut run_home = usize::MAX;
        for step in 1..=cap {
            let i = (start + step) % cap;
            let z = t.slots[i].0;
            if z == EMPTY {
                prev = None;
                continue;
            }
            let d = t.distance(i);
            match prev {
                None if d != 0 => return Err(format!("the entry at slot {i} is not at its home after an empty slot")),
                Some(p) if d > p + 1 => return Err(format!("the entry at slot {i} is out of its probe order")),
                _ => {}
            }
            let h = t.home(z);
            if prev.is_none() || h != run_home {
                run.clear();
                run_home = h;
            }
            if run.contains(&z) {
                return Err(format!("key {} is in the table twice", unmix(z)));
            }
            if run.len() == MAX_RUN {
                return Err(format!("more than {MAX_RUN} entries share the home of slot {h}"));
            }
            run.push(z);
            prev = Some(d);
            t.len += 1;
        }
        if t.len * MAX_FILL_DEN > cap * MAX_FILL_NUM {
            return Err(format!("{} entries in {cap} slots: fuller than a table is kept", t.len));
        }
        Ok(t)
    }

    /// A table of `entries`: mixed keys, ascending and distinct (mixed key 0 is key 0),
    /// sized 3/4 full. Ascending mixed keys are ascending homes, so each entry goes to
    /// its home or the first free slot after the one before: the layout Robin Hood
    /// insertion reaches, without its probes and shifts. Entries pushed past the end
    /// wrap round by plain insertion.
    pub(crate) fn from_sorted(entries: &[(u64, V)]) -> Self {
        let mut t = Table::default();
        let (zero, rest) = match entries.first() {
            Some(&(EMPTY, v)) => (Some(v), &entries[1..]),
            _ => (None, entries),
        };
        t.zero = zero;
        if rest.is_empty() {
            return t;
        }
        let cap = (rest.len() * 4).div_ceil(3).max(MIN_CAPACITY);
        t.slots = vec![(EMPTY, V::default()); cap];
        let mut free = 0; // no entry placed at or after this slot yet
        let mut wrapped = Vec::new();
        for &(z, v) in rest {
            let i = t.home(z).max(free);
            if i == cap {
                wrapped.push((z, v));
                continue;
            }
            t.slots[i] = (z, v);
            t.len += 1;
            free = i + 1;
        }
        for (z, v) in wrapped {
            t.place(z, v);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn unmix_inverts_mix() {
        let mut x = 1u64;
        for _ in 0..10_000 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            assert_eq!(unmix(mix(x)), x);
        }
        assert_eq!((mix(0), unmix(0)), (0, 0));
    }

    /// Random inserts, entries, updates and removes against std's HashMap (keys from a
    /// small range, 0 included, so that runs collide and the zero slot is used).
    #[test]
    fn behaves_as_a_map() {
        let mut t: Table<u64> = Table::default();
        let mut m: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 5_000;
            match x >> 62 {
                0 | 1 => assert_eq!(t.insert(key, step), m.insert(key, step)),
                2 => {
                    *t.entry(key) += 1;
                    *m.entry(key).or_default() += 1;
                }
                _ => assert_eq!(t.remove(&key), m.remove(&key)),
            }
            assert_eq!(t.get(&key), m.get(&key));
        }
        assert_eq!(t.len(), m.len());
        let mut all: Vec<(u64, u64)> = t.iter().collect();
        all.sort_unstable();
        let mut want: Vec<(u64, u64)> = m.into_iter().collect();
        want.sort_unstable();
        assert_eq!(all, want);
    }

    fn sorted_of(t: &Table<u64>) -> Vec<(u64, u64)> {
        let mut all: Vec<(u64, u64)> = t.iter().collect();
        all.sort_unstable();
        all
    }

    /// Raw parts copied back give the same map; built from sorted keys gives the map
    /// inserting them gives, and both stay usable.
    #[test]
    fn raw_and_sorted_round_trip() {
        for n in [0u64, 1, 7, 100, 5_000] {
            let mut t: Table<u64> = Table::default();
            for k in 0..n {
                t.insert(k.wrapping_mul(0x9e37_79b9_7f4a_7c15) % 1_000_000, k);
            }
            let (slots, zero) = t.raw();
            let mut copy = Table::from_raw(slots.to_vec(), zero).expect("valid");
            assert_eq!(sorted_of(&copy), sorted_of(&t));
            let mut mixed: Vec<(u64, u64)> = t.iter().map(|(k, v)| (mix(k), v)).collect();
            mixed.sort_unstable();
            let mut built = Table::from_sorted(&mixed);
            assert_eq!(sorted_of(&built), sorted_of(&t));
            for k in 0..n {
                let key = k.wrapping_mul(0x9e37_79b9_7f4a_7c15) % 1_000_000;
                assert_eq!(copy.get(&key), Some(&k));
                assert_eq!(built.get(&key), Some(&k));
                if k % 3 == 0 {
                    assert_eq!(copy.remove(&key), Some(k));
                    assert_eq!(built.remove(&key), Some(k));
                }
            }
            copy.insert(u64::MAX, 1);
            built.insert(u64::MAX, 1);
            assert_eq!(sorted_of(&copy), sorted_of(&built));
        }
    }

    #[test]
    fn damaged_raw_parts_are_refused() {
        let mut t: Table<u64> = Table::default();
        for k in 1..1_000u64 {
            t.insert(k, k);
        }
        let (slots, _) = t.raw();
        let keys: Vec<u64> = slots.iter().map(|s| s.0).collect();
        let with_keys = |ks: Vec<u64>| -> Vec<(u64, u64)> { ks.into_iter().zip(slots.iter().map(|s| s.1)).collect() };
        let full = keys.iter().position(|&z| z != EMPTY).unwrap();
        let empty = keys.iter().position(|&z| z == EMPTY).unwrap();
        let mut moved = keys.to_vec();
        moved.swap(full, empty);
        let mut twice = keys.to_vec();
        let at = (0..twice.len()).find(|&i| twice[i] != EMPTY && twice[(i + 1) % twice.len()] == EMPTY).unwrap();
        let n = twice.len();
        twice[(at + 1) % n] = twice[at];
        let mut wrong = keys.to_vec();
        wrong[full] ^= 1 << 63;
        for (bad, why) in [(moved, "home"), (twice, "twice"), (wrong, "")] {
            let err = Table::from_raw(with_keys(bad), None).err();
            assert!(err.as_deref().is_some_and(|e| e.contains(why)), "{err:?}");
        }
        assert!(Table::<u64>::from_raw(vec![(1, 0); 16], None).err().unwrap().contains("no empty slot"));
        assert!(Table::<u64>::from_raw(vec![(0, 0); 4], None).err().unwrap().contains("capacity 4"));
    }
}
