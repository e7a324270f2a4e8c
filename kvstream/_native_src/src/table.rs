//! The index's per-slot reverse maps (index.rs: block hash → position): u64 keys
//! (hashes, small engine ids) to small `Copy` values, Robin Hood open addressing with
//! backward-shift deletion.
//!
//! Why not std's HashMap: its bucket count is a power of two, so a table sits anywhere
//! between 44 % and 87 % full, and these maps (one per worker slot and tier, a block
//! each) were half of the 1 M-block index's ~50 bytes of RSS per block. Here a key's
//! home slot is `mixed key · capacity >> 64` for any capacity, so a table grows by half
//! and stays 60–90 % full. Robin Hood keeps probe runs short at that fill: a lookup
//! stops as soon as it passes where its key would have been placed. (Growing by a
//! quarter kept tables fuller but made applying events ~2× slower, all in rehashing;
//! the owners table, looked up once per prompt position, stays std's: this layout
//! matched no faster there.)
use std::mem;

/// Grow when more than 9/10 full; by half.
const MAX_FILL_NUM: usize = 9;
const MAX_FILL_DEN: usize = 10;
const MIN_CAPACITY: usize = 8;
/// Stored key of an empty slot; the entry of key 0 (mixed: 0) is kept aside.
const EMPTY: u64 = 0;

/// splitmix64's finalizer (engine block ids may be small consecutive ints). A
/// bijection: the table stores keys mixed, so that a slot's home is known without
/// mixing again while probing, and `unmix` gives the key back.
#[inline]
fn mix(k: u64) -> u64 {
    let mut z = k;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn unmix(z: u64) -> u64 {
    let mut z = z ^ (z >> 31) ^ (z >> 62);
    z = z.wrapping_mul(0x3196_42b2_d24d_8ec3);
    z = z ^ (z >> 27) ^ (z >> 54);
    z = z.wrapping_mul(0x96de_1b17_3f11_9089);
    z ^ (z >> 30) ^ (z >> 60)
}

pub(crate) struct Table<V: Copy + Default> {
    /// Mixed keys; probing reads only these (8 bytes a slot), the value once found.
    keys: Vec<u64>,
    values: Vec<V>,
    /// Entries in the slots (not counting `zero`).
    len: usize,
    zero: Option<V>,
}

impl<V: Copy + Default> Default for Table<V> {
    fn default() -> Self {
        Table { keys: Vec::new(), values: Vec::new(), len: 0, zero: None }
    }
}

impl<V: Copy + Default> Table<V> {
    /// Home slot of a mixed key.
    #[inline]
    fn home(&self, z: u64) -> usize {
        ((u128::from(z) * self.keys.len() as u128) >> 64) as usize
    }

    /// How far the entry at `i` sits from its home.
    #[inline]
    fn distance(&self, i: usize) -> usize {
        let h = self.home(self.keys[i]);
        if i >= h {
            i - h
        } else {
            i + self.keys.len() - h
        }
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.keys.len() {
            0
        } else {
            i + 1
        }
    }

    /// The slot of mixed key `z` (not 0).
    #[inline]
    fn find(&self, z: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut i = self.home(z);
        let mut d = 0;
        loop {
            let k = self.keys[i];
            if k == z {
                return Some(i);
            }
            if k == EMPTY || self.distance(i) < d {
                return None;
            }
            i = self.next(i);
            d += 1;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots allocated (for the memory estimate).
    pub(crate) fn capacity(&self) -> usize {
        self.keys.len()
    }

    pub(crate) fn get(&self, key: &u64) -> Option<&V> {
        let z = mix(*key);
        if z == EMPTY {
            return self.zero.as_ref();
        }
        self.find(z).map(|i| &self.values[i])
    }

    /// Room for `extra` more entries without growing on the way.
    pub(crate) fn reserve(&mut self, extra: usize) {
        let want = self.len + extra;
        if want * MAX_FILL_DEN > self.keys.len() * MAX_FILL_NUM {
            let fits = (want * MAX_FILL_DEN).div_ceil(MAX_FILL_NUM);
            self.resize(fits.max(self.keys.len() + self.keys.len() / 2).max(MIN_CAPACITY));
        }
    }

    fn resize(&mut self, capacity: usize) {
        let keys = mem::replace(&mut self.keys, vec![EMPTY; capacity]);
        let values = mem::replace(&mut self.values, vec![V::default(); capacity]);
        self.len = 0;
        for (z, v) in keys.into_iter().zip(values) {
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
            if self.keys[i] == EMPTY {
                self.keys[i] = z;
                self.values[i] = v;
                self.len += 1;
                return;
            }
            let here = self.distance(i);
            if here < d {
                // Take the slot of an entry nearer its home; carry that one on.
                mem::swap(&mut self.keys[i], &mut z);
                mem::swap(&mut self.values[i], &mut v);
                d = here;
            }
            i = self.next(i);
            d += 1;
        }
    }

    /// Set `key` to `value`; returns the previous value. One pass: the probe that
    /// misses the key is where it goes (Robin Hood: the key would sit no further).
    pub(crate) fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let z = mix(key);
        if z == EMPTY {
            return self.zero.replace(value);
        }
        self.reserve(1);
        let mut i = self.home(z);
        let mut d = 0;
        loop {
            let k = self.keys[i];
            if k == z {
                return Some(mem::replace(&mut self.values[i], value));
            }
            if k == EMPTY || self.distance(i) < d {
                self.place_from(i, d, z, value);
                return None;
            }
            i = self.next(i);
            d += 1;
        }
    }

    pub(crate) fn remove(&mut self, key: &u64) -> Option<V> {
        let z = mix(*key);
        if z == EMPTY {
            return self.zero.take();
        }
        let mut i = self.find(z)?;
        let value = self.values[i];
        // Shift the run after it back by one, up to an empty slot or an entry at home.
        let mut j = self.next(i);
        while self.keys[j] != EMPTY && self.distance(j) > 0 {
            self.keys[i] = self.keys[j];
            self.values[i] = self.values[j];
            i = j;
            j = self.next(j);
        }
        self.keys[i] = EMPTY;
        self.len -= 1;
        Some(value)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        self.zero.map(|v| (0, v)).into_iter().chain(
            self.keys.iter().zip(&self.values).filter(|(&z, _)| z != EMPTY).map(|(&z, &v)| (unmix(z), v)),
        )
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = V> + '_ {
        self.iter().map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts, updates and removes against std's HashMap (keys from a small
    /// range, 0 included, so that runs collide and the zero slot is used).
    #[test]
    fn unmix_inverts_mix() {
        let mut x = 1u64;
        for _ in 0..10_000 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            assert_eq!(unmix(mix(x)), x);
        }
        assert_eq!((mix(0), unmix(0)), (0, 0));
    }

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
            match x >> 63 {
                0 => assert_eq!(t.insert(key, step), m.insert(key, step)),
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
}
