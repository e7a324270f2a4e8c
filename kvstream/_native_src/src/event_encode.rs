//! Avro body of a `kvstream.events.EventBatch` v1 record, written in one call
//! (kvstream/events/codec.py's fast path on the publish side). The generic path (the
//! record as dicts through fastavro) is the reference: tests check both give the same
//! bytes, and the codec uses this one only when the current schema is v1's layout.
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

fn zigzag(out: &mut Vec<u8>, v: i64) {
    let mut z = ((v << 1) ^ (v >> 63)) as u64;
    while z >= 0x80 {
        out.push((z as u8) | 0x80);
        z >>= 7;
    }
    out.push(z as u8);
}

/// A tuple of u64 ints as Avro `bytes` of packed little-endian u64.
fn packed(out: &mut Vec<u8>, hashes: &Bound<'_, PyTuple>) -> PyResult<()> {
    zigzag(out, 8 * hashes.len() as i64);
    out.reserve(8 * hashes.len());
    for h in hashes.iter() {
        let v: u64 = h
            .extract()
            .map_err(|_| PyOverflowError::new_err("hashes must be ints in [0, 2**64)"))?;
        out.extend_from_slice(&v.to_le_bytes());
    }
    Ok(())
}

/// `header` (marker and fingerprint) followed by the body. Each event is a tuple
/// `(kind index, dp_rank, tier index, event_id, parent_hash or None, block_hashes,
/// tokens_hashes)` with enum indexes of the current schema; u64 values travel as the
/// long with the same 64 bits.
#[pyfunction]
pub fn encode_event_batch<'py>(
    py: Python<'py>,
    header: &[u8],
    worker_id: u64,
    epoch: u64,
    lease_ms: u64,
    events: &Bound<'py, PyTuple>,
) -> PyResult<Bound<'py, PyBytes>> {
    if lease_ms > i64::MAX as u64 {
        return Err(PyOverflowError::new_err("lease_ms must be in [0, 2**63)"));
    }
    let mut out = Vec::with_capacity(header.len() + 32 + 64 * events.len());
    out.extend_from_slice(header);
    zigzag(&mut out, worker_id as i64);
    zigzag(&mut out, epoch as i64);
    zigzag(&mut out, lease_ms as i64);
    if !events.is_empty() {
        zigzag(&mut out, events.len() as i64);
        for ev in events.iter() {
            let ev = ev.cast::<PyTuple>().map_err(|_| PyTypeError::new_err("events must be tuples"))?;
            let (kind, dp_rank, tier, event_id, parent, blocks, tokens): (
                u8,
                u32,
                u8,
                u64,
                Option<u64>,
                Bound<'py, PyTuple>,
                Bound<'py, PyTuple>,
            ) = ev.extract()?;
            zigzag(&mut out, i64::from(dp_rank));
            zigzag(&mut out, i64::from(tier));
            zigzag(&mut out, event_id as i64);
            zigzag(&mut out, i64::from(kind));
            match parent {
                None => zigzag(&mut out, 0),
                Some(p) => {
                    zigzag(&mut out, 1);
                    zigzag(&mut out, p as i64);
                }
            }
            packed(&mut out, &blocks)?;
            packed(&mut out, &tokens)?;
        }
    }
    zigzag(&mut out, 0);
    Ok(PyBytes::new(py, &out))
}
