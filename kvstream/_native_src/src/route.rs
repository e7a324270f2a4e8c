//! The routing decision in one call (DESIGN.md §4–§6), called from
//! kvstream/router/core.py: hashing (or the caller's local hashes), matching across tiers
//! (index.rs), the active-sequence load, the §5 terms, the policy's cost (`Cost`: kv or
//! ttft), the filters with their reasons, the choice, and the add of the routed request.
//! The only implementation of these rules.
//!
//! tests/router/reference_router.py is the reference model: the property tests
//! (tests/router/test_core_properties.py) check that this gives the same candidates, the
//! same terms and costs to the last bit, the same reasons and the same choice for the same
//! uniform draw. So the arithmetic below follows the reference's order of operations
//! exactly (no reassociation, no fused multiply-add), and the draw walks the
//! probabilities as its `_draw` does.
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::expect::Stamp;
use crate::index::{IndexCore, Map, COLS};
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

struct Req {
    key: Key,
    prefill: i64,
    hashes: Vec<u64>,
    serial: u64,
    /// Active decode blocks of the worker when the request was added.
    decode: i64,
    /// When it was added, until its first prefill_done (the ttft policy learns from it).
    added: Option<f64>,
}

struct Load {
    prefill: i64,
    /// sequence hash → running requests holding it (shared blocks counted once).
    blocks: Map<u64, u32>,
    requests: i64,
    /// (serial, added, prefill tokens) of the requests not past their first token, in
    /// the order they were added: the engine's first-come-first-served prefill queue.
    queue: Vec<(u64, f64, i64)>,
    /// The latest first token of a request at the queue's head: those queued behind it
    /// started no earlier.
    last_done: f64,
}

impl Default for Load {
    fn default() -> Self {
        Load { prefill: 0, blocks: Map::default(), requests: 0, queue: Vec::new(), last_done: f64::NEG_INFINITY }
    }
}

impl Load {
    /// The prefill tokens still queued at `now`, at `per_token` seconds a token. The
    /// whole prompts of the queued requests overstate it: the one at the head is partly
    /// done, computed since it could start (its add, or the latest first token before
    /// it); those behind it wait for its first token, not seen yet (at 1x the
    /// conversation trace, 4,298 queued tokens took 192 ms to drain, not the 897 ms
    /// they would whole).
    fn queued(&self, now: f64, per_token: f64) -> f64 {
        let Some(&(_, added, head)) = self.queue.first() else { return 0.0 };
        let behind: i64 = self.queue[1..].iter().map(|q| q.2).sum();
        let start = added.max(self.last_done);
        (head as f64 - (now - start).max(0.0) / per_token).max(0.0) + behind as f64
    }

    fn dequeue(&mut self, serial: u64) {
        if let Some(i) = self.queue.iter().position(|q| q.0 == serial) {
            self.queue.remove(i);
        }
    }
}

/// Columns of a load row: (has load entry, prefill tokens, decode blocks, requests, new
/// blocks).
const LOAD_COLS: usize = 5;

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

/// Weights and filters of one decision: the fields of
/// kvstream.router.scheduler.SchedulerConfig (with the request's overrides), read by
/// their names from the config object, so that the Python dataclass is their one
/// definition (a renamed field fails the first route, loudly).
#[derive(FromPyObject)]
struct Weights {
    overlap_score_credit: f64,
    host_cache_hit_weight: f64,
    disk_cache_hit_weight: f64,
    prefill_load_scale: f64,
    decode_active_request_weight: f64,
    router_temperature: f64,
    max_active_decode_blocks: Option<i64>,
    max_active_prefill_tokens: Option<i64>,
    allowed_workers: Option<HashSet<i64>>,
    ttft_host_onboard_ratio: f64,
    ttft_disk_onboard_ratio: f64,
    ttft_recompute_weight: f64,
    ttft_decode_delay_weight: f64,
    expected_cache_hit_weight: f64,
}

impl Weights {
    fn filtered(&self) -> bool {
        self.allowed_workers.is_some() || self.max_active_decode_blocks.is_some() || self.max_active_prefill_tokens.is_some()
    }

    /// Why candidate `i` may not take the request (the filters of §5), else None.
    fn exclusion(&self, worker: i64, ld: &[i64], i: usize) -> Option<String> {
        if self.allowed_workers.as_ref().is_some_and(|a| !a.contains(&worker)) {
            return Some("not in allowed_workers".to_string());
        }
        let (apt, adb) = (ld[LOAD_COLS * i + 1], ld[LOAD_COLS * i + 2]);
        if let Some(limit) = self.max_active_decode_blocks.filter(|&m| adb > m) {
            return Some(format!("busy: {adb} active decode blocks > {limit}"));
        }
        if let Some(limit) = self.max_active_prefill_tokens.filter(|&m| apt > m) {
            return Some(format!("busy: {apt} active prefill tokens > {limit}"));
        }
        None
    }

    /// Why no candidate is eligible (all `n` are excluded for `reasons`).
    fn why_none(&self, keys: &[(usize, Key)], reasons: &[Option<String>]) -> String {
        if let Some(allowed) = &self.allowed_workers {
            if keys.iter().all(|(_, k)| !allowed.contains(&k.0)) {
                let mut want: Vec<i64> = allowed.iter().copied().collect();
                want.sort_unstable();
                let mut known: Vec<i64> = keys.iter().map(|(_, k)| k.0).collect();
                known.sort_unstable();
                known.dedup();
                return format!("none of the allowed workers {} is known (known: {})", py_list(&want), py_list(&known));
            }
        }
        let detail: Vec<String> = keys
            .iter()
            .zip(reasons)
            .map(|((_, k), r)| format!("{}/{}: {}", k.0, k.1, r.as_deref().unwrap_or("None")))
            .collect();
        format!("all {} candidates are excluded: {}", keys.len(), detail.join("; "))
    }
}

/// A list of ints as Python prints it.
fn py_list(xs: &[i64]) -> String {
    let parts: Vec<String> = xs.iter().map(i64::to_string).collect();
    format!("[{}]", parts.join(", "))
}

/// What a policy's cost reads of the candidates.
struct Inputs<'a> {
    isl: i64,
    block_size: i64,
    /// n×5 overlaps and n×5 loads, as in `Decision`.
    overlaps: &'a [i64],
    loads: &'a [i64],
    n: usize,
}

/// A routing policy: the cost of each candidate, lower wins (DESIGN.md §5;
/// kvstream/router/costs.py documents both), and the prefill it counted as queued on
/// each when that is not the load's whole queue. `terms` are the §5 terms (logit_columns).
trait Cost {
    fn costs(&self, x: &Inputs, terms: &[f64]) -> (Vec<f64>, Option<Vec<f64>>);
}

/// `kv`: worker_logit itself.
struct KvCost;

impl Cost for KvCost {
    fn costs(&self, x: &Inputs, terms: &[f64]) -> (Vec<f64>, Option<Vec<f64>>) {
        (terms[6 * x.n..].to_vec(), None)
    }
}

/// The busy share past which the ttft cost's recompute weight grows no more.
const BUSY_CAP: f64 = 0.9;

/// `ttft`: the predicted time to first token in ms, plus the weighted delay the
/// request's uncached prefill puts on later ones, at the learned prefill rates.
struct TtftCost<'a> {
    /// Tokens/s per candidate (the learner's, kvstream/router/rates.py).
    rates: &'a [f64],
    /// The candidates' queues, read at `now`.
    active: &'a ActiveCore,
    keys: &'a [(usize, Key)],
    now: f64,
    /// Seconds per prefilled token per active decode block.
    decode_slowdown: f64,
    host_ratio: f64,
    disk_ratio: f64,
    recompute_weight: f64,
    /// Weight of the delay the request's prefill puts on the requests running there.
    decode_delay_weight: f64,
    /// The share of an expected block counted as cached.
    expected_weight: f64,
    /// Costs within this share of the lowest are not told apart (`within_error`).
    band: f64,
}

impl TtftCost<'_> {
    /// Per candidate, its time per prefilled token, in seconds, and the prefill queued
    /// there, in tokens (what is left of it: `Load::queued`).
    fn queues(&self, x: &Inputs) -> Vec<(f64, f64)> {
        (0..x.n)
            .map(|i| {
                let row = &x.loads[LOAD_COLS * i..LOAD_COLS * (i + 1)];
                let has = row[0] != 0;
                let decode = if has { row[2] } else { 0 };
                let per_token = 1.0 / self.rates[i] + decode as f64 * self.decode_slowdown;
                let ahead = match self.active.loads.get(&self.keys[i].1) {
                    Some(ld) if has => ld.queued(self.now, per_token),
                    _ => 0.0,
                };
                (per_token, ahead)
            })
            .collect()
    }

    /// Candidate `i`'s prompt tokens to compute (in the reference's order of operations).
    fn uncached(&self, x: &Inputs, i: usize) -> f64 {
        let o = &x.overlaps[COLS * i..COLS * (i + 1)];
        let (dev, host, disk, ext, exp) = (o[0] as f64, o[1] as f64, o[2] as f64, o[3] as f64, o[4] as f64);
        (x.isl as f64 - (dev + host + disk + ext + self.expected_weight * exp) * x.block_size as f64).max(0.0)
    }

    /// At temperature 0, of the `eligible` candidates (their costs `lg`) those within
    /// `band` of the lowest cost, then of those the ones with the fewest uncached tokens:
    /// the others' costs become +inf, so that the argmin and its ties are over these
    /// (kvstream/router/costs.py; the reference's within_error).
    fn within_error(&self, x: &Inputs, lg: &mut [f64], eligible: &[usize]) {
        if self.band <= 0.0 {
            return;
        }
        let limit = lg.iter().copied().fold(f64::INFINITY, f64::min) * (1.0 + self.band);
        let uncached: Vec<f64> = eligible.iter().map(|&i| self.uncached(x, i)).collect();
        let fewest = (0..lg.len()).filter(|&e| lg[e] <= limit).map(|e| uncached[e]).fold(f64::INFINITY, f64::min);
        for (e, l) in lg.iter_mut().enumerate() {
            if *l > limit || uncached[e] > fewest {
                *l = f64::INFINITY;
            }
        }
    }

    /// The costs, given the candidates' `queues`. In the reference's order of
    /// operations (tests/router/reference_router.py, predicted_ttft, over numpy columns).
    fn costs_of(&self, x: &Inputs, queues: &[(f64, f64)]) -> Vec<f64> {
        let (n, bs) = (x.n, x.block_size as f64);
        // The delay a unit of work adds to later arrivals grows as b/(1 - b) with the
        // share b of busy candidates (any request running), capped where it would explode.
        let busy = (0..n).filter(|&i| x.loads[LOAD_COLS * i] != 0).count();
        let b = (busy as f64 / n.max(1) as f64).min(BUSY_CAP);
        let recompute = self.recompute_weight * b / (1.0 - b);
        (0..n)
            .map(|i| {
                let o = &x.overlaps[COLS * i..COLS * (i + 1)];
                let (host, disk, ext) = (o[1] as f64, o[2] as f64, o[3] as f64);
                let row = &x.loads[LOAD_COLS * i..LOAD_COLS * (i + 1)];
                let uncached = self.uncached(x, i);
                let onboard = (self.host_ratio * host + self.disk_ratio * (disk + ext)) * bs;
                let running = if row[0] != 0 { row[3] } else { 0 };
                let (per_token, ahead) = queues[i];
                let others = self.decode_delay_weight * running as f64 * (uncached + onboard);
                (ahead + (1.0 + recompute) * uncached + onboard + others) * per_token * 1000.0
            })
            .collect()
    }
}

impl Cost for TtftCost<'_> {
    fn costs(&self, x: &Inputs, _terms: &[f64]) -> (Vec<f64>, Option<Vec<f64>>) {
        let queues = self.queues(x);
        (self.costs_of(x, &queues), Some(queues.iter().map(|q| q.1).collect()))
    }
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
        let decode = load.blocks.len() as i64;
        let serial = self.serial;
        self.serial += 1;
        load.prefill += prefill;
        load.requests += 1;
        if prefill > 0 {
            load.queue.push((serial, ts, prefill));
        }
        for &h in &hashes {
            *load.blocks.entry(h).or_insert(0) += 1;
        }
        self.expiry.push(Reverse((Stamp(ts), serial, rid.clone())));
        self.requests.insert(rid, Req { key, prefill, hashes, serial, decode, added: Some(ts) });
        true
    }

    /// Free a request: its worker, and the hashes of its prompt that no other request
    /// running there holds (None when it was not active).
    fn free_req(&mut self, rid: &str) -> Option<(Key, Vec<u64>)> {
        let req = self.requests.remove(rid)?;
        let load = self.loads.get_mut(&req.key).expect("a request's worker has a load entry");
        load.prefill -= req.prefill;
        load.requests -= 1;
        if req.prefill != 0 {
            load.dequeue(req.serial);
        }
        if load.requests == 0 {
            self.loads.remove(&req.key); // its blocks go with it
            return Some((req.key, req.hashes));
        }
        let mut alone = Vec::new();
        for &h in &req.hashes {
            if let Some(c) = load.blocks.get_mut(&h) {
                if *c == 1 {
                    load.blocks.remove(&h);
                    alone.push(h);
                } else {
                    *c -= 1;
                }
            }
        }
        Some((req.key, alone))
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
    fn load_row(&self, key: &Key, seqs: &[u64]) -> [i64; LOAD_COLS] {
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
    /// credit, cached, prefill, prefill_cost, decode, request_cost, logit (n each); the
    /// logit column is the policy's cost.
    columns: Vec<f64>,
    probs: Vec<f64>,
    /// Under ttft, per candidate the prefill it counted as queued there, in tokens.
    queued: Option<Vec<f64>>,
    seqs: Vec<u64>,
    /// Per candidate, why it is excluded (None: eligible); None when no filter is set.
    excluded: Option<Vec<Option<String>>>,
    /// Why none is eligible, when `chosen` is None.
    why_none: Option<String>,
    /// The prompt's length in tokens.
    isl: i64,
}

/// §5, term by term, in the reference's order of operations (worker_logits in
/// tests/router/reference_router.py).
fn logit_columns(w: &Weights, isl: i64, bs: i64, ov: &[i64], ld: &[i64], n: usize) -> Vec<f64> {
    let mut cols = vec![0f64; 7 * n];
    for i in 0..n {
        let o = &ov[COLS * i..COLS * (i + 1)];
        let (dev, host, disk, ext, exp) = (o[0], o[1], o[2], o[3], o[4]);
        let row = &ld[LOAD_COLS * i..LOAD_COLS * (i + 1)];
        let (has, apt, adb, reqs, new) = (row[0], row[1], row[2], row[3], row[4]);
        let credit = w.overlap_score_credit * dev as f64 + w.host_cache_hit_weight * host as f64 + w.disk_cache_hit_weight * (disk + ext) as f64
            + w.expected_cache_hit_weight * exp as f64;
        let cached = (credit * bs as f64 + 0.5).floor();
        let prefill = if has != 0 {
            (apt as f64 + (isl as f64 - cached).max(0.0) + cached) / bs as f64
        } else {
            isl as f64 / bs as f64
        };
        let prefill_cost = w.prefill_load_scale * (prefill - credit).max(0.0);
        let decode = adb + new;
        let request_cost = w.decode_active_request_weight * reqs as f64;
        let logit = prefill_cost + decode as f64 + request_cost;
        for (c, v) in [credit, cached, prefill, prefill_cost, decode as f64, request_cost, logit].into_iter().enumerate() {
            cols[c * n + i] = v;
        }
    }
    cols
}

/// Selection probabilities over `logits` (the reference's probabilities, same sums in
/// order). (Python 3.11's sum() of floats adds in order from 0, as the fold does; 3.12's
/// is compensated, which this would have to follow.)
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

/// This replica's part of the candidates when several route at once: `part` of `parts`
/// (kvstream.router.router.Router.split_ties).
#[derive(Clone, Copy)]
pub(crate) struct Split {
    part: usize,
    parts: usize,
}

impl Split {
    /// Keep, of the tied candidates, those in this replica's part: the candidates in key
    /// order cut into `parts` runs, the `part`-th run (or every tie when none is in it).
    /// Replicas with the same view break a tie the same way at random; at once, before
    /// each other's load ops arrive, they would pick one idle worker for many requests
    /// (at 4 replicas a third of the conversation trace's requests did).
    fn ties(self, p: &mut [f64], eligible: &[usize], keys: &[(usize, Key)]) {
        let tied = p.iter().filter(|&&x| x > 0.0).count();
        if self.parts < 2 || tied < 2 {
            return;
        }
        // Rank r is in run floor(r·parts/n): the run's keys lie from the key of rank
        // ceil(part·n/parts) up to that of the next run's first rank (two selections,
        // no sort: a decision over a large fleet stays linear).
        let n = keys.len();
        let first = |run: usize| (run * n).div_ceil(self.parts);
        let mut ks: Vec<Key> = keys.iter().map(|k| k.1).collect();
        let mut key_of = |rank: usize| (rank < n).then(|| *ks.select_nth_unstable(rank).1);
        let Some(lo) = key_of(first(self.part)) else { return };
        let hi = key_of(first(self.part + 1));
        let mine = |e: usize| {
            let k = keys[eligible[e]].1;
            k >= lo && hi.is_none_or(|h| k < h)
        };
        let kept = (0..p.len()).filter(|&e| p[e] > 0.0 && mine(e)).count();
        if kept == 0 || kept == tied {
            return;
        }
        for (e, x) in p.iter_mut().enumerate() {
            *x = if *x > 0.0 && mine(e) { 1.0 / kept as f64 } else { 0.0 };
        }
    }
}

/// The index drawn by the uniform `r` (the reference's _draw).
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

/// The prompt a decision is about: its length in tokens and its blocks' sequence hashes.
struct Prompt {
    isl: i64,
    seqs: Vec<u64>,
}

/// The learned prefill rates the ttft cost reads (kvstream/router/rates.py).
struct Rates {
    per_candidate: Vec<f64>,
    decode_slowdown: f64,
    /// Costs within this share of the lowest are not told apart (`TtftCost::within_error`:
    /// `ttft_error_band` × the model's relative error, kvstream/router/core.py).
    band: f64,
}

#[allow(clippy::too_many_arguments)]
fn decide(
    index: &IndexCore,
    active: &ActiveCore,
    keys: &[(usize, Key)],
    prompt: Prompt,
    block_size: usize,
    w: &Weights,
    rates: Option<&Rates>,
    r: f64,
    split: Split,
    now: f64,
) -> PyResult<Decision> {
    let Prompt { isl, mut seqs } = prompt;
    // Every hash is there already: the walk's fill has nothing to add.
    let found = index.walk(seqs.len(), &mut seqs, &mut |_, _| Ok(()))?;
    let n = keys.len();
    // slot → candidate row (slots are small ints in slot order).
    let max_slot = keys.last().map_or(0, |k| k.0 + 1);
    let mut row_of = vec![usize::MAX; max_slot];
    for (i, (slot, _)) in keys.iter().enumerate() {
        row_of[*slot] = i;
    }
    let mut overlaps = vec![0i64; COLS * n];
    for (slot, c) in found {
        if let Some(&i) = row_of.get(slot).filter(|&&i| i != usize::MAX) {
            for t in 0..COLS {
                overlaps[COLS * i + t] = c[t] as i64;
            }
        }
    }
    let mut loads = Vec::with_capacity(LOAD_COLS * n);
    for (_, key) in keys {
        loads.extend_from_slice(&active.load_row(key, &seqs));
    }
    let mut columns = logit_columns(w, isl, block_size as i64, &overlaps, &loads, n);
    let inputs = Inputs { isl, block_size: block_size as i64, overlaps: &overlaps, loads: &loads, n };
    // The policy is the cost whose inputs the caller passed (kvstream/router/costs.py:
    // kv reads nothing learned, ttft the learned rates).
    let ttft = rates.map(|rates| TtftCost {
        rates: &rates.per_candidate,
        active,
        keys,
        now,
        decode_slowdown: rates.decode_slowdown,
        host_ratio: w.ttft_host_onboard_ratio,
        disk_ratio: w.ttft_disk_onboard_ratio,
        recompute_weight: w.ttft_recompute_weight,
        decode_delay_weight: w.ttft_decode_delay_weight,
        expected_weight: w.expected_cache_hit_weight,
        band: rates.band,
    });
    let (costs, queued) = match &ttft {
        None => KvCost.costs(&inputs, &columns),
        Some(ttft) => ttft.costs(&inputs, &columns),
    };
    columns[6 * n..].copy_from_slice(&costs);
    let excluded: Option<Vec<Option<String>>> =
        w.filtered().then(|| (0..n).map(|i| w.exclusion(keys[i].1 .0, &loads, i)).collect());
    let eligible: Vec<usize> = match &excluded {
        None => (0..n).collect(),
        Some(reasons) => (0..n).filter(|&i| reasons[i].is_none()).collect(),
    };
    let mut probs = vec![0f64; n];
    let mut chosen = None;
    let mut why_none = None;
    if eligible.is_empty() {
        why_none = Some(match &excluded {
            Some(reasons) => w.why_none(keys, reasons),
            None => "no workers known: none has published an event within its lease".to_string(),
        });
    } else {
        let logit = &columns[6 * n..];
        let mut lg: Vec<f64> = eligible.iter().map(|&i| logit[i]).collect();
        if let Some(ttft) = &ttft {
            ttft.within_error(&inputs, &mut lg, &eligible);
        }
        let mut p = probabilities(&lg, w.router_temperature);
        if w.router_temperature == 0.0 || lg.iter().all(|&x| x == lg[0]) {
            split.ties(&mut p, &eligible, keys);
        }
        chosen = Some(eligible[draw(&p, r)]);
        for (&i, &pi) in eligible.iter().zip(&p) {
            probs[i] = pi;
        }
    }
    Ok(Decision { chosen, overlaps, loads, columns, probs, queued, seqs, excluded, why_none, isl })
}

/// Hashes given as a list of ints or as little-endian u64 bytes.
pub(crate) fn hashes_from(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    match obj.cast::<PyBytes>() {
        Ok(b) => {
            let data = b.as_bytes();
            if data.len() % 8 != 0 {
                return Err(PyValueError::new_err(format!("packed hashes of {} bytes: not a multiple of 8", data.len())));
            }
            Ok(data.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk"))).collect())
        }
        Err(_) => obj.extract::<Vec<u64>>(),
    }
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
        let hashes = hashes_from(sequence_hashes)?;
        Ok(self.add_req(request_id, (worker_id, dp_rank), isl, overlap_tokens, hashes, timestamp))
    }

    /// The request's prefill tokens stop loading its worker. (False, None) when not
    /// active; else (True, and on its first prefill_done (worker_id, dp_rank, its prefill
    /// tokens, seconds since it could start, decode blocks when added) for the ttft
    /// policy's rates). It could start when it was added or when the worker's previous
    /// first token came, whichever is later (first come, first served): its own
    /// prefill's time, not the queue's before it.
    #[allow(clippy::type_complexity)]
    fn prefill_done(&mut self, request_id: &str, timestamp: f64) -> (bool, Option<(i64, i64, i64, f64, i64)>) {
        let Some(req) = self.requests.get_mut(request_id) else { return (false, None) };
        let load = self.loads.get_mut(&req.key).expect("a request's worker has a load entry");
        // Only the queue's head moves its start on: a short prompt can finish in the
        // chunks left over beside an older long one, which has started long before.
        let head = load.queue.first().is_none_or(|q| q.0 == req.serial);
        let seen = req.added.take().map(|t| {
            let start = t.max(load.last_done);
            if head {
                load.last_done = load.last_done.max(timestamp);
            }
            (req.key.0, req.key.1, req.prefill, timestamp - start, req.decode)
        });
        if req.prefill != 0 {
            load.prefill -= req.prefill;
            load.dequeue(req.serial);
            req.prefill = 0;
        }
        (true, seen)
    }

    /// Free a request: None when not active, else its (worker_id, dp_rank) and the
    /// prompt's sequence hashes (little-endian u64 bytes) no other request running there
    /// holds (what a request that failed before its prompt was computed no longer
    /// predicts there).
    fn free<'py>(&mut self, py: Python<'py>, request_id: &str) -> Option<(Key, Bound<'py, PyBytes>)> {
        self.free_req(request_id).map(|(key, alone)| (key, le_bytes(py, &alone, u64::to_le_bytes)))
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

    /// One routing decision. `keys`: per slot, its (worker_id, dp_rank) or None for a
    /// free slot (the candidates are the slots in use, in slot order); `config`: a
    /// SchedulerConfig (its fields by name: `Weights`); `seed`: the local hashes' seed
    /// (kvstream.hashing.identity_seed: adapter and cache salt); `local`: the prompt's
    /// local hashes when the caller computed them (multimodal or extra-token blocks,
    /// kvstream.hashing.local_hashes), else the core hashes the tokens; `rates`: the
    /// learned tokens/s per candidate, the decode slowdown and the band of costs not told apart (the ttft policy's
    /// inputs, and so the policy: without them the cost is kv); `r`: the uniform draw in [0, 1); `split`: (part, parts), this replica's part of the candidates for a tie (`Split`). Expires old requests at `now` first;
    /// with `request_id`, adds the request to the chosen worker.
    ///
    /// Returns (chosen row or None when no candidate is eligible, overlaps (n×5 i64: the tiers, then the expected blocks),
    /// loads (n×5 i64), columns (7×n f64: the §5 terms, the last the policy's cost),
    /// probabilities (n f64), all as little-endian bytes, under ttft the prefill it
    /// counted as queued on each candidate (n f64 tokens, else None), the prompt's
    /// sequence hashes (little-endian u64 bytes) when tracked, its token count, per candidate why it is
    /// excluded (None without filters), why none is eligible).
    /// The GIL is released while hashing, matching and scoring.
    #[pyo3(signature = (index, keys, tokens, block_size, seed, config, r, now, request_id=None, local=None, rates=None, max_tokens=usize::MAX, split=(0, 1)))]
    #[allow(clippy::too_many_arguments)]
    fn route<'py>(
        &mut self,
        py: Python<'py>,
        index: PyRefMut<'py, IndexCore>,
        keys: Vec<Option<Key>>,
        tokens: &Bound<'py, PyAny>,
        block_size: usize,
        seed: u64,
        config: Weights,
        r: f64,
        now: f64,
        request_id: Option<String>,
        local: Option<&Bound<'py, PyAny>>,
        rates: Option<(Vec<f64>, f64, f64)>,
        max_tokens: usize,
        split: (usize, usize),
    ) -> PyResult<Routed<'py>> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be positive"));
        }
        let toks = route_tokens(tokens, max_tokens)?;
        let local = match local {
            None => None,
            Some(obj) => {
                let hashes = hashes_from(obj)?;
                if hashes.len() != toks.len() / block_size {
                    return Err(PyValueError::new_err(format!(
                        "{} local hashes for a prompt of {} full blocks",
                        hashes.len(),
                        toks.len() / block_size
                    )));
                }
                Some(hashes)
            }
        };
        let isl = toks.len() as i64;
        let hash = move || {
            let local = local.unwrap_or_else(|| local_hashes_of(&toks, block_size, seed));
            Prompt { isl, seqs: sequence_of(&local, None) }
        };
        self.route_prompt(py, index, keys, hash, block_size, config, rates, (r, split_of(split)?), now, request_id)
    }

    /// The decision for a prompt given by its length and its blocks' sequence hashes
    /// (a logged request: the log keeps no token ids), query-only; otherwise as `route`.
    #[pyo3(signature = (index, keys, isl, sequence_hashes, block_size, config, r, now, rates=None, split=(0, 1)))]
    #[allow(clippy::too_many_arguments)]
    fn route_hashes<'py>(
        &mut self,
        py: Python<'py>,
        index: PyRefMut<'py, IndexCore>,
        keys: Vec<Option<Key>>,
        isl: i64,
        sequence_hashes: &Bound<'py, PyAny>,
        block_size: usize,
        config: Weights,
        r: f64,
        now: f64,
        rates: Option<(Vec<f64>, f64, f64)>,
        split: (usize, usize),
    ) -> PyResult<Routed<'py>> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be positive"));
        }
        let seqs = hashes_from(sequence_hashes)?;
        self.route_prompt(py, index, keys, move || Prompt { isl, seqs }, block_size, config, rates, (r, split_of(split)?), now, None)
    }
}

/// `split` (part, parts) checked: part < parts.
fn split_of((part, parts): (usize, usize)) -> PyResult<Split> {
    if part >= parts {
        return Err(PyValueError::new_err(format!("split part {part} of {parts}: needs part < parts")));
    }
    Ok(Split { part, parts })
}

/// What `route` returns (see there).
type Routed<'py> = (
    Option<usize>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Option<Bound<'py, PyBytes>>,
    Option<Bound<'py, PyBytes>>,
    usize,
    Option<Vec<Option<String>>>,
    Option<String>,
);

impl ActiveCore {
    #[allow(clippy::too_many_arguments)]
    fn route_prompt<'py>(
        &mut self,
        py: Python<'py>,
        index: PyRefMut<'py, IndexCore>,
        keys: Vec<Option<Key>>,
        prompt: impl FnOnce() -> Prompt + Send,
        block_size: usize,
        w: Weights,
        rates: Option<(Vec<f64>, f64, f64)>,
        (r, split): (f64, Split),
        now: f64,
        request_id: Option<String>,
    ) -> PyResult<Routed<'py>> {
        let keys: Vec<(usize, Key)> = keys.into_iter().enumerate().filter_map(|(s, k)| k.map(|k| (s, k))).collect();
        let rates = match rates {
            Some((per_candidate, decode_slowdown, band)) if per_candidate.len() == keys.len() => {
                Some(Rates { per_candidate, decode_slowdown, band })
            }
            Some((per_candidate, ..)) => {
                return Err(PyValueError::new_err(format!("{} rates for {} candidates", per_candidate.len(), keys.len())))
            }
            None => None,
        };
        let mut index = index;
        let idx: &mut IndexCore = &mut index;
        let track = request_id.is_some();
        let d = py.detach(|| -> PyResult<Decision> {
            let prompt = prompt();
            let isl = prompt.isl;
            self.expire_at(now);
            idx.expect.expire(now);
            let d = decide(idx, self, &keys, prompt, block_size, &w, rates.as_ref(), r, split, now)?;
            if let (Some(rid), Some(c)) = (request_id, d.chosen) {
                // The caller checked that the id is not active (the borrow of self keeps
                // other threads out meanwhile), so the add applies.
                let cached = d.columns[keys.len() + c] as i64;
                self.add_req(rid, keys[c].1, isl, cached, d.seqs.clone(), now);
                // The prompt's blocks past what the slot holds are expected there now.
                let held: i64 = d.overlaps[COLS * c..COLS * c + 4].iter().sum();
                idx.expect.add(keys[c].0, &d.seqs, held as usize, now);
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
            d.queued.as_ref().map(|q| le_bytes(py, q, f64::to_le_bytes)),
            tracked,
            d.isl as usize,
            d.excluded,
            d.why_none,
        ))
    }
}
