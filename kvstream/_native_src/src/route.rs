//! The kv routing decision in one call (DESIGN.md §4–§6), called from
//! kvstream/router/core.py: hashing, matching across tiers (index.rs), the active-sequence
//! load, `worker_logit` and the choice, and the add of the routed request.
//!
//! kvstream/router/active.py and scheduler.py are the reference model: the property tests
//! (tests/router/test_core_properties.py) check that this gives the same candidates, the
//! same logit terms to the last bit and the same choice for the same uniform draw. So the
//! arithmetic below follows the reference's order of operations exactly (no reassociation,
//! no fused multiply-add), and the draw walks the probabilities as `_draw` does.
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::index::{IndexCore, Map};
use crate::{local_hashes_of, sequence_of, token_error, tokens_from_list};

type Key = (i64, i64);

/// Token ids of a route call: a buffer of native u32 (numpy uint32, array('I')), packed
/// little-endian u32 bytes (bytes, bytearray, a byte memoryview: an HTTP body), or a list
/// of ints. Each is validated: a byte body must be a whole number of u32.
fn route_tokens(obj: &Bound<'_, PyAny>, max_tokens: usize) -> PyResult<Vec<u32>> {
    let toks = if let Ok(buf) = PyBuffer::<u32>::get(obj) {
        check_len(buf.item_count(), max_tokens)?;
        buf.to_vec(obj.py())?
    } else if let Ok(buf) = PyBuffer::<u8>::get(obj) {
        let n = buf.item_count();
        if n % 4 != 0 {
            return Err(PyValueError::new_err(format!(
                "a binary prompt is little-endian u32 token ids: {n} bytes is not a multiple of 4"
            )));
        }
        check_len(n / 4, max_tokens)?;
        let bytes = buf.to_vec(obj.py())?;
        bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    } else if let Ok(list) = obj.cast::<PyList>() {
        check_len(list.len(), max_tokens)?;
        tokens_from_list(list)?
    } else {
        return Err(token_error());
    };
    Ok(toks)
}

fn check_len(n: usize, max_tokens: usize) -> PyResult<()> {
    if n > max_tokens {
        return Err(PyValueError::new_err(format!("prompt of {n} tokens exceeds the limit of {max_tokens}")));
    }
    Ok(())
}

/// A timestamp ordered totally (the expiry heap's key).
#[derive(Clone, Copy, PartialEq)]
struct Stamp(f64);
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

struct Req {
    key: Key,
    prefill: i64,
    hashes: Vec<u64>,
    serial: u64,
    /// Prefill tokens queued on the worker when the request was added.
    ahead: i64,
    /// Active decode blocks of the worker when the request was added.
    decode: i64,
    /// When it was added, until its first prefill_done (the ttft policy learns from it).
    added: Option<f64>,
}

#[derive(Default)]
struct Load {
    prefill: i64,
    /// sequence hash → running requests holding it (shared blocks counted once).
    blocks: Map<u64, u32>,
    requests: i64,
}

/// Length of the prefix of `seqs` that `blocks` holds. The blocks of running requests
/// are prefix-closed (each holds its whole chain), so the held part is a prefix.
fn held_prefix(blocks: &Map<u64, u32>, seqs: &[u64]) -> usize {
    let n = seqs.len();
    if n == 0 || !blocks.contains_key(&seqs[0]) {
        return 0;
    }
    if blocks.contains_key(&seqs[n - 1]) {
        return n;
    }
    let (mut lo, mut hi) = (1, n - 1);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if blocks.contains_key(&seqs[mid]) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Weights and filters of one decision (SchedulerConfig with the request's overrides).
#[derive(Clone)]
struct Weights {
    overlap: f64,
    host: f64,
    disk: f64,
    prefill_scale: f64,
    request_weight: f64,
    temperature: f64,
    max_decode: Option<i64>,
    max_prefill: Option<i64>,
    allowed: Option<Vec<i64>>,
}

/// The active sequences (DESIGN.md §6) and the decision over them.
#[pyclass(module = "kvstream._native")]
pub struct ActiveCore {
    ttl: f64,
    requests: Map<String, Req>,
    loads: Map<Key, Load>,
    expiry: BinaryHeap<Reverse<(Stamp, u64, String)>>,
    serial: u64,
}

impl ActiveCore {
    fn add_req(&mut self, rid: String, key: Key, isl: i64, overlap: i64, hashes: Vec<u64>, ts: f64) -> bool {
        if self.requests.contains_key(&rid) {
            return false;
        }
        let prefill = (isl - overlap).max(0);
        let load = self.loads.entry(key).or_default();
        let ahead = load.prefill;
        let decode = load.blocks.len() as i64;
        load.prefill += prefill;
        load.requests += 1;
        for &h in &hashes {
            *load.blocks.entry(h).or_insert(0) += 1;
        }
        let serial = self.serial;
        self.serial += 1;
        self.expiry.push(Reverse((Stamp(ts), serial, rid.clone())));
        self.requests.insert(rid, Req { key, prefill, hashes, serial, ahead, decode, added: Some(ts) });
        true
    }

    fn free_req(&mut self, rid: &str) -> bool {
        let Some(req) = self.requests.remove(rid) else { return false };
        let load = self.loads.get_mut(&req.key).expect("a request's worker has a load entry");
        load.prefill -= req.prefill;
        load.requests -= 1;
        if load.requests == 0 {
            self.loads.remove(&req.key); // its blocks go with it
            return true;
        }
        for h in &req.hashes {
            if let Some(c) = load.blocks.get_mut(h) {
                if *c == 1 {
                    load.blocks.remove(h);
                } else {
                    *c -= 1;
                }
            }
        }
        true
    }

    fn expire_at(&mut self, now: f64) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(Reverse((Stamp(ts), _, _))) = self.expiry.peek() {
            if !(now - *ts > self.ttl) {
                break;
            }
            let Reverse((_, serial, rid)) = self.expiry.pop().expect("peeked");
            if self.requests.get(&rid).is_some_and(|r| r.serial == serial) {
                self.free_req(&rid);
                out.push(rid);
            }
        }
        out
    }

    /// (has load, prefill tokens, decode blocks, requests, new blocks of `seqs`).
    fn load_row(&self, key: &Key, seqs: &[u64]) -> [i64; 5] {
        match self.loads.get(key) {
            None => [0, 0, 0, 0, seqs.len() as i64],
            Some(ld) => [
                1,
                ld.prefill,
                ld.blocks.len() as i64,
                ld.requests,
                (seqs.len() - held_prefix(&ld.blocks, seqs)) as i64,
            ],
        }
    }
}

/// What `decide` computed, as columns (kvstream/router/core.py wraps them in numpy).
struct Decision {
    chosen: Option<usize>,
    overlaps: Vec<i64>,
    loads: Vec<i64>,
    /// credit, cached, prefill, prefill_cost, decode, request_cost, logit (n each).
    columns: Vec<f64>,
    probs: Vec<f64>,
    seqs: Vec<u64>,
}

/// §5, term by term, in the reference's order of operations (scheduler.worker_logits).
fn logit_columns(w: &Weights, isl: i64, bs: i64, ov: &[i64], ld: &[i64], n: usize) -> Vec<f64> {
    let mut cols = vec![0f64; 7 * n];
    for i in 0..n {
        let (dev, host, disk, ext) = (ov[4 * i], ov[4 * i + 1], ov[4 * i + 2], ov[4 * i + 3]);
        let (has, apt, adb, reqs, new) = (ld[5 * i], ld[5 * i + 1], ld[5 * i + 2], ld[5 * i + 3], ld[5 * i + 4]);
        let credit = w.overlap * dev as f64 + w.host * host as f64 + w.disk * (disk + ext) as f64;
        let cached = (credit * bs as f64 + 0.5).floor();
        let prefill = if has != 0 {
            (apt as f64 + (isl as f64 - cached).max(0.0) + cached) / bs as f64
        } else {
            isl as f64 / bs as f64
        };
        let prefill_cost = w.prefill_scale * (prefill - credit).max(0.0);
        let decode = adb + new;
        let request_cost = w.request_weight * reqs as f64;
        let logit = prefill_cost + decode as f64 + request_cost;
        for (c, v) in [credit, cached, prefill, prefill_cost, decode as f64, request_cost, logit].into_iter().enumerate() {
            cols[c * n + i] = v;
        }
    }
    cols
}

/// Selection probabilities over `logits` (scheduler.probabilities, same sums in order).
/// (Python 3.11's sum() of floats adds in order from 0, as the fold does; 3.12's is
/// compensated, which this would have to follow.)
fn probabilities(logits: &[f64], t: f64) -> Vec<f64> {
    let lo = logits.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if t == 0.0 || lo == hi {
        let ties = logits.iter().filter(|&&x| x == lo).count() as f64;
        return logits.iter().map(|&x| if x == lo { 1.0 / ties } else { 0.0 }).collect();
    }
    let scale = (hi - lo) * t;
    let weights: Vec<f64> = logits.iter().map(|&x| (-(x - lo) / scale).exp()).collect();
    let total = weights.iter().fold(0.0, |a, &b| a + b);
    weights.iter().map(|&x| x / total).collect()
}

/// The index drawn by the uniform `r` (scheduler._draw).
fn draw(probs: &[f64], r: f64) -> usize {
    let (mut acc, mut last) = (0.0, 0);
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            acc += p;
            last = i;
            if r < acc {
                return i;
            }
        }
    }
    last
}

#[allow(clippy::too_many_arguments)]
fn decide(
    index: &IndexCore,
    active: &ActiveCore,
    keys: &[(usize, Key)],
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    w: &Weights,
    r: f64,
) -> PyResult<Decision> {
    let mut seqs = sequence_of(&local_hashes_of(tokens, block_size, seed), None);
    // Every hash is there already: the walk's fill has nothing to add.
    let found = index.walk(seqs.len(), &mut seqs, &mut |_, _| Ok(()))?;
    let n = keys.len();
    // slot → candidate row (slots are small ints in slot order).
    let max_slot = keys.last().map_or(0, |k| k.0 + 1);
    let mut row_of = vec![usize::MAX; max_slot];
    for (i, (slot, _)) in keys.iter().enumerate() {
        row_of[*slot] = i;
    }
    let mut overlaps = vec![0i64; 4 * n];
    for (slot, c) in found {
        if let Some(&i) = row_of.get(slot).filter(|&&i| i != usize::MAX) {
            for t in 0..4 {
                overlaps[4 * i + t] = c[t] as i64;
            }
        }
    }
    let mut loads = Vec::with_capacity(5 * n);
    for (_, key) in keys {
        loads.extend_from_slice(&active.load_row(key, &seqs));
    }
    let isl = tokens.len() as i64;
    let columns = logit_columns(w, isl, block_size as i64, &overlaps, &loads, n);
    let logit = &columns[6 * n..];
    let eligible: Vec<usize> = (0..n)
        .filter(|&i| {
            let worker = keys[i].1 .0;
            w.allowed.as_ref().is_none_or(|a| a.contains(&worker))
                && w.max_decode.is_none_or(|m| loads[5 * i + 2] <= m)
                && w.max_prefill.is_none_or(|m| loads[5 * i + 1] <= m)
        })
        .collect();
    let mut probs = vec![0f64; n];
    let mut chosen = None;
    if !eligible.is_empty() {
        let lg: Vec<f64> = eligible.iter().map(|&i| logit[i]).collect();
        let p = probabilities(&lg, w.temperature);
        chosen = Some(eligible[draw(&p, r)]);
        for (&i, &pi) in eligible.iter().zip(&p) {
            probs[i] = pi;
        }
    }
    Ok(Decision { chosen, overlaps, loads, columns, probs, seqs })
}

fn le_bytes<'py, T: Copy, const N: usize>(py: Python<'py>, xs: &[T], f: impl Fn(T) -> [u8; N]) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(xs.len() * N);
    for &x in xs {
        out.extend_from_slice(&f(x));
    }
    PyBytes::new(py, &out)
}

#[pymethods]
impl ActiveCore {
    #[new]
    fn new(ttl_s: f64) -> PyResult<Self> {
        if !(ttl_s > 0.0) {
            return Err(PyValueError::new_err(format!("ttl_s must be > 0, got {ttl_s}")));
        }
        Ok(ActiveCore { ttl: ttl_s, requests: Map::default(), loads: Map::default(), expiry: BinaryHeap::new(), serial: 0 })
    }

    fn __len__(&self) -> usize {
        self.requests.len()
    }

    fn __contains__(&self, request_id: &str) -> bool {
        self.requests.contains_key(request_id)
    }

    /// Add a routed request; False when the id is already active (nothing applied).
    #[allow(clippy::too_many_arguments)]
    /// `sequence_hashes`: a list of ints, or little-endian u64 bytes (as `route` returns them).
    fn add(&mut self, request_id: String, worker_id: i64, dp_rank: i64, isl: i64, overlap_tokens: i64, sequence_hashes: &Bound<'_, PyAny>, timestamp: f64) -> PyResult<bool> {
        let hashes = match sequence_hashes.cast::<PyBytes>() {
            Ok(b) => {
                let data = b.as_bytes();
                if data.len() % 8 != 0 {
                    return Err(PyValueError::new_err(format!("packed hashes of {} bytes: not a multiple of 8", data.len())));
                }
                data.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk"))).collect()
            }
            Err(_) => sequence_hashes.extract::<Vec<u64>>()?,
        };
        Ok(self.add_req(request_id, (worker_id, dp_rank), isl, overlap_tokens, hashes, timestamp))
    }

    /// The request's prefill tokens stop loading its worker. (False, None) when not
    /// active; else (True, and on its first prefill_done (worker_id, dp_rank, tokens ahead
    /// + its own, seconds since added, decode blocks when added) for the ttft policy's rates).
    #[allow(clippy::type_complexity)]
    fn prefill_done(&mut self, request_id: &str, timestamp: f64) -> (bool, Option<(i64, i64, i64, f64, i64)>) {
        let Some(req) = self.requests.get_mut(request_id) else { return (false, None) };
        let seen = req.added.take().map(|t| (req.key.0, req.key.1, req.ahead + req.prefill, timestamp - t, req.decode));
        if req.prefill != 0 {
            self.loads.get_mut(&req.key).expect("load entry").prefill -= req.prefill;
            req.prefill = 0;
        }
        (true, seen)
    }

    /// Free a request; False when not active.
    fn free(&mut self, request_id: &str) -> bool {
        self.free_req(request_id)
    }

    /// Free the requests routed more than the TTL before `now`; returns their ids.
    fn expire(&mut self, now: f64) -> Vec<String> {
        self.expire_at(now)
    }

    /// Drop the requests running on any rank of a worker; returns their ids.
    fn remove_worker(&mut self, worker_id: i64) -> Vec<String> {
        let gone: Vec<String> = self.requests.iter().filter(|(_, r)| r.key.0 == worker_id).map(|(k, _)| k.clone()).collect();
        for rid in &gone {
            self.free_req(rid);
        }
        gone
    }

    /// (prefill tokens, decode blocks, requests), or None without a load entry.
    fn load(&self, worker_id: i64, dp_rank: i64) -> Option<(i64, i64, i64)> {
        self.loads.get(&(worker_id, dp_rank)).map(|l| (l.prefill, l.blocks.len() as i64, l.requests))
    }

    fn worker_of(&self, request_id: &str) -> Option<Key> {
        self.requests.get(request_id).map(|r| r.key)
    }

    /// Per key: (has load entry, prefill tokens, decode blocks, requests, new blocks).
    fn loads_for(&self, keys: Vec<Key>, seq_hashes: Vec<u64>) -> Vec<(bool, i64, i64, i64, i64)> {
        keys.iter()
            .map(|k| {
                let r = self.load_row(k, &seq_hashes);
                (r[0] != 0, r[1], r[2], r[3], r[4])
            })
            .collect()
    }

    /// One kv decision. `keys`: per slot, its (worker_id, dp_rank) or None for a free
    /// slot (the candidates are the slots in use, in slot order); `weights`: (overlap_score_credit, host_cache_hit_weight,
    /// disk_cache_hit_weight, prefill_load_scale, decode_active_request_weight,
    /// router_temperature); `r`: the uniform draw in [0, 1). Expires old requests at
    /// `now` first; with `request_id`, adds the request to the chosen worker.
    ///
    /// Returns (chosen row or None when no candidate is eligible, overlaps (n×4 i64),
    /// loads (n×5 i64), logit columns (7×n f64), probabilities (n f64), all as
    /// little-endian bytes, the prompt's sequence hashes (little-endian u64 bytes) when
    /// tracked, its token count).
    /// The GIL is released while hashing, matching and scoring.
    #[pyo3(signature = (index, keys, tokens, block_size, seed, weights, filters, r, now, request_id=None, max_tokens=usize::MAX))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn route<'py>(
        &mut self,
        py: Python<'py>,
        index: PyRef<'py, IndexCore>,
        keys: Vec<Option<Key>>,
        tokens: &Bound<'py, PyAny>,
        block_size: usize,
        seed: u64,
        weights: (f64, f64, f64, f64, f64, f64),
        filters: (Option<i64>, Option<i64>, Option<Vec<i64>>),
        r: f64,
        now: f64,
        request_id: Option<String>,
        max_tokens: usize,
    ) -> PyResult<(Option<usize>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>, usize)> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be positive"));
        }
        let toks = route_tokens(tokens, max_tokens)?;
        let w = Weights {
            overlap: weights.0,
            host: weights.1,
            disk: weights.2,
            prefill_scale: weights.3,
            request_weight: weights.4,
            temperature: weights.5,
            max_decode: filters.0,
            max_prefill: filters.1,
            allowed: filters.2,
        };
        let keys: Vec<(usize, Key)> = keys.into_iter().enumerate().filter_map(|(s, k)| k.map(|k| (s, k))).collect();
        let idx: &IndexCore = &index;
        let track = request_id.is_some();
        let d = py.detach(|| -> PyResult<Decision> {
            self.expire_at(now);
            let d = decide(idx, self, &keys, &toks, block_size, seed, &w, r)?;
            if let (Some(rid), Some(c)) = (request_id, d.chosen) {
                // The caller checked that the id is not active (the borrow of self keeps
                // other threads out meanwhile), so the add applies.
                let cached = d.columns[keys.len() + c] as i64;
                self.add_req(rid, keys[c].1, toks.len() as i64, cached, d.seqs.clone(), now);
            }
            Ok(d)
        })?;
        let tracked = (track && d.chosen.is_some()).then(|| le_bytes(py, &d.seqs, u64::to_le_bytes));
        Ok((
            d.chosen,
            le_bytes(py, &d.overlaps, i64::to_le_bytes),
            le_bytes(py, &d.loads, i64::to_le_bytes),
            le_bytes(py, &d.columns, f64::to_le_bytes),
            le_bytes(py, &d.probs, f64::to_le_bytes),
            tracked,
            toks.len(),
        ))
    }
}
