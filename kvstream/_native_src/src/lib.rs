//! Batch block hashing for kvstream (DESIGN.md §1), called from kvstream/hashing.py.
//!
//! One call hashes a whole prompt, so the Python per-block call overhead (which dominates
//! at 512 blocks of 16 tokens) is paid once. kvstream/hashing.py holds the pure-Python
//! definition of the same rules; tests check both give identical results.
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;
use pyo3::ffi;
use xxhash_rust::xxh3::xxh3_64_with_seed;

mod avro_check;
mod event_decode;
mod event_encode;
mod expect;
mod index;
mod route;
mod table;
mod tokens_json;

/// Seed of the chained sequence hash (and of local hashes without LoRA).
const CHAIN_SEED: u64 = 1337;

fn tokens_from(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    // Fast path: any buffer of native u32 (numpy uint32, array('I')).
    if let Ok(buf) = PyBuffer::<u32>::get(obj) {
        return buf.to_vec(obj.py());
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return tokens_from_list(list);
    }
    obj.extract::<Vec<u32>>().map_err(|_| token_error())
}

fn token_error() -> PyErr {
    PyValueError::new_err("token ids must be a sequence of integers in [0, 2**32)")
}

/// Requests carry token ids as a list of Python ints; reading them through the C API
/// directly is several times faster than pyo3's generic sequence extraction.
fn tokens_from_list(list: &Bound<'_, PyList>) -> PyResult<Vec<u32>> {
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    let ptr = list.as_ptr();
    for i in 0..n {
        // SAFETY: i < len and the GIL is held, so the borrowed item is alive; no Python
        // code runs between the length read and the loop.
        let v = unsafe {
            let item = ffi::PyList_GET_ITEM(ptr, i as ffi::Py_ssize_t);
            if ffi::PyLong_Check(item) == 0 {
                return Err(token_error());
            }
            ffi::PyLong_AsUnsignedLong(item) as u64
        };
        if v == std::ffi::c_ulong::MAX as u64 {
            // Either u64::MAX itself or a conversion error (a negative int, an overflow).
            let _ = PyErr::take(list.py());
            return Err(token_error());
        }
        out.push(u32::try_from(v).map_err(|_| token_error())?);
    }
    Ok(out)
}

/// Item `i` of `list` as a u64 (a hash), read through the C API: pyo3's generic
/// `get_item` + `extract` cost more than the rest of a lookup while matching. Errors as
/// `extract` gives them (TypeError for a non-integer, OverflowError outside [0, 2**64)).
pub(crate) fn u64_at(list: &Bound<'_, PyList>, i: usize) -> PyResult<u64> {
    if i >= list.len() {
        return Err(pyo3::exceptions::PyIndexError::new_err("list index out of range"));
    }
    // SAFETY: i < len and the GIL is held, so the borrowed item is alive.
    let item = unsafe { ffi::PyList_GET_ITEM(list.as_ptr(), i as ffi::Py_ssize_t) };
    if unsafe { ffi::PyLong_Check(item) } == 0 {
        return list.get_item(i)?.extract::<u64>(); // numpy ints and other __index__ types
    }
    // SAFETY: as above; item is an int.
    let v = unsafe { ffi::PyLong_AsUnsignedLongLong(item) };
    if v == u64::MAX {
        // u64::MAX itself, or a conversion error (a negative int, an overflow, not an int).
        if let Some(err) = PyErr::take(list.py()) {
            return Err(err);
        }
    }
    Ok(v)
}

fn local_hashes_of(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    let mut bytes = vec![0u8; block_size * 4];
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            for (dst, t) in bytes.chunks_exact_mut(4).zip(block) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            xxh3_64_with_seed(&bytes, seed)
        })
        .collect()
}

pub(crate) fn chain(parent: u64, local: u64) -> u64 {
    let mut pair = [0u8; 16];
    pair[..8].copy_from_slice(&parent.to_le_bytes());
    pair[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&pair, CHAIN_SEED)
}

pub(crate) fn sequence_of(local: &[u64], parent: Option<u64>) -> Vec<u64> {
    let mut out = Vec::with_capacity(local.len());
    let mut prev = parent;
    for &l in local {
        let s = match prev {
            None => l,
            Some(p) => chain(p, l),
        };
        out.push(s);
        prev = Some(s);
    }
    out
}

/// Local hashes of the full blocks of `tokens`, and their chained sequence hashes when
/// `with_sequence` is true (else an empty list).
#[pyfunction]
#[pyo3(signature = (tokens, block_size, seed, with_sequence))]
fn block_hashes(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    block_size: usize,
    seed: u64,
    with_sequence: bool,
) -> PyResult<(Vec<u64>, Vec<u64>)> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be positive"));
    }
    let toks = tokens_from(tokens)?;
    Ok(py.detach(|| {
        let local = local_hashes_of(&toks, block_size, seed);
        let seq = if with_sequence { sequence_of(&local, None) } else { Vec::new() };
        (local, seq)
    }))
}

/// Chained sequence hashes of `local`, continuing from `parent` when given.
#[pyfunction]
#[pyo3(signature = (local, parent=None))]
fn sequence_hashes(local: Vec<u64>, parent: Option<u64>) -> Vec<u64> {
    sequence_of(&local, parent)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(sequence_hashes, m)?)?;
    m.add_class::<index::IndexCore>()?;
    m.add_class::<index::WorkerTables>()?;
    m.add_class::<route::ActiveCore>()?;
    m.add_class::<avro_check::AvroLayout>()?;
    m.add_function(wrap_pyfunction!(event_encode::encode_event_batch, m)?)?;
    m.add_class::<event_decode::EventBatchReader>()?;
    m.add_function(wrap_pyfunction!(tokens_json::tokenize_answer_ids, m)?)?;
    Ok(())
}
