//! The token ids of an engine's `/tokenize` answer, read straight into packed u32s: the
//! gateway asks one engine per text prompt (`[gateway] tokenize = "engine"`), and decoding
//! its thousands of ids into Python ints cost more than the request's routing.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde::Deserialize;

/// The part of a vLLM/SGLang `/tokenize` answer the gateway reads; other fields are
/// ignored, a missing `tokens` or an id outside [0, 2**32) is an error.
#[derive(Deserialize)]
struct Tokenized {
    tokens: Vec<u32>,
}

/// `answer`'s `tokens` as little-endian u32 bytes; ValueError with serde_json's reason
/// (and where in the answer) when it is not such a JSON object.
#[pyfunction]
pub fn tokenize_answer_ids<'py>(py: Python<'py>, answer: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let parsed: Tokenized = serde_json::from_slice(answer).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let mut out = Vec::with_capacity(parsed.tokens.len() * 4);
    for t in parsed.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    Ok(PyBytes::new(py, &out))
}
