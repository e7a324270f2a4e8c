//! Strict validation of Avro binary bodies (DESIGN.md §2), called from
//! kvstream/events/codec.py before fastavro decodes a body.
//!
//! fastavro's compiled reader is fast but lenient: a negative enum or union index picks
//! a symbol or branch by Python's negative indexing, and a varint longer than ten bytes
//! (or whose tenth byte carries bits beyond 64) wraps into some value. Apache Avro's
//! reference decoders reject all of these. This walk rejects them too, in one pass over
//! the writer schema's layout, so that fastavro only ever sees bodies the references
//! accept. tests/events/test_avro_oracle.py checks the result against Apache Avro's
//! reference Python decoder.
//!
//! The schema arrives as a flat list of nodes (kvstream/events/strict.py builds it from
//! fastavro's parsed form); children are node indexes, so named and recursive types are
//! plain references.
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Node kinds, as numbered in kvstream/events/strict.py.
const NULL: u8 = 0;
const BOOLEAN: u8 = 1;
const INT: u8 = 2;
const LONG: u8 = 3;
const FLOAT: u8 = 4;
const DOUBLE: u8 = 5;
const BYTES: u8 = 6;
const STRING: u8 = 7;
const FIXED: u8 = 8;
const ENUM: u8 = 9;
const ARRAY: u8 = 10;
const MAP: u8 = 11;
const UNION: u8 = 12;
const RECORD: u8 = 13;

/// Deeper nesting than this is refused (only recursive schemas nest deeply), so that a
/// hostile body cannot exhaust a thread's stack.
const MAX_DEPTH: usize = 64;

struct Node {
    kind: u8,
    /// Fixed: size; enum: number of symbols.
    size: u64,
    children: Vec<usize>,
    name: String,
}

/// Why a body is refused: `truncated` (input ran out) or `malformed`, and a message.
struct Refusal {
    truncated: bool,
    message: String,
}

type Check<T> = Result<T, Refusal>;

fn malformed(message: String) -> Refusal {
    Refusal { truncated: false, message }
}

fn truncated(what: &str, pos: usize) -> Refusal {
    Refusal { truncated: true, message: format!("input ends inside {what} at byte {pos}") }
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    /// A zig-zag varint long, refused like the references do: more than ten bytes, or a
    /// tenth byte with any bit beyond bit 63 of the value.
    fn long(&mut self, what: &str) -> Check<i64> {
        let start = self.pos;
        let mut n: u64 = 0;
        let mut shift = 0u32;
        loop {
            let Some(&b) = self.data.get(self.pos) else {
                return Err(truncated(what, self.pos));
            };
            self.pos += 1;
            if shift == 63 && b & 0xFE != 0 {
                return Err(malformed(format!(
                    "{what}: varint at byte {start} is longer than 64 bits (10th byte {b:#04x})"
                )));
            }
            n |= u64::from(b & 0x7F) << shift;
            if b & 0x80 == 0 {
                return Ok(((n >> 1) as i64) ^ -((n & 1) as i64));
            }
            shift += 7;
        }
    }

    fn skip(&mut self, n: u64, what: &str) -> Check<&[u8]> {
        let left = (self.data.len() - self.pos) as u64;
        if n > left {
            return Err(Refusal {
                truncated: true,
                message: format!("{what} of {n} bytes at byte {} but only {left} left", self.pos),
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.data[start..self.pos])
    }

    fn length(&mut self, what: &str) -> Check<u64> {
        let start = self.pos;
        let n = self.long(what)?;
        if n < 0 {
            return Err(malformed(format!("{what}: negative length {n} at byte {start}")));
        }
        Ok(n as u64)
    }

    /// An enum symbol or union branch index, in [0, count).
    fn index(&mut self, count: u64, what: &str, name: &str) -> Check<usize> {
        let start = self.pos;
        let i = self.long(what)?;
        if i < 0 || i as u64 >= count {
            return Err(malformed(format!(
                "{what} {name}: index {i} at byte {start} is outside [0, {count})"
            )));
        }
        Ok(i as usize)
    }
}

/// A writer schema's layout, ready to check bodies.
#[pyclass(frozen)]
pub struct AvroLayout {
    nodes: Vec<Node>,
}

impl AvroLayout {
    fn check_node(&self, r: &mut Reader<'_>, at: usize, depth: usize) -> Check<()> {
        if depth > MAX_DEPTH {
            return Err(malformed(format!("values nested deeper than {MAX_DEPTH} levels")));
        }
        let node = &self.nodes[at];
        match node.kind {
            NULL => {}
            BOOLEAN => {
                let b = r.skip(1, "boolean")?[0];
                if b > 1 {
                    return Err(malformed(format!("boolean byte {b:#04x} at byte {} is neither 0 nor 1", r.pos - 1)));
                }
            }
            INT => {
                let start = r.pos;
                let v = r.long("int")?;
                if i32::try_from(v).is_err() {
                    return Err(malformed(format!("int {v} at byte {start} is outside 32 bits")));
                }
            }
            LONG => {
                r.long("long")?;
            }
            FLOAT => {
                r.skip(4, "float")?;
            }
            DOUBLE => {
                r.skip(8, "double")?;
            }
            BYTES => {
                let n = r.length("bytes length")?;
                r.skip(n, "bytes")?;
            }
            STRING => {
                let start = r.pos;
                let n = r.length("string length")?;
                if std::str::from_utf8(r.skip(n, "string")?).is_err() {
                    return Err(malformed(format!("string at byte {start} is not UTF-8")));
                }
            }
            FIXED => {
                r.skip(node.size, &node.name)?;
            }
            ENUM => {
                r.index(node.size, "enum", &node.name)?;
            }
            ARRAY | MAP => loop {
                let count = r.long("block count")?;
                if count == 0 {
                    break;
                }
                if count < 0 {
                    r.long("block size")?;
                }
                // Items take at least one byte (checked when schemas load), so a huge
                // count runs out of input after at most len(data) items.
                for _ in 0..count.unsigned_abs() {
                    if node.kind == MAP {
                        let start = r.pos;
                        let n = r.length("map key length")?;
                        if std::str::from_utf8(r.skip(n, "map key")?).is_err() {
                            return Err(malformed(format!("map key at byte {start} is not UTF-8")));
                        }
                    }
                    self.check_node(r, node.children[0], depth + 1)?;
                }
            },
            UNION => {
                let branch = r.index(node.children.len() as u64, "union", &node.name)?;
                self.check_node(r, node.children[branch], depth + 1)?;
            }
            RECORD => {
                for &field in &node.children {
                    self.check_node(r, field, depth + 1)?;
                }
            }
            other => return Err(malformed(format!("unknown node kind {other}"))),
        }
        Ok(())
    }
}

#[pymethods]
impl AvroLayout {
    /// `nodes`: (kind, size, children, name) per node; node 0 is the root.
    #[new]
    fn new(nodes: Vec<(u8, u64, Vec<usize>, String)>) -> PyResult<Self> {
        let count = nodes.len();
        if count == 0 {
            return Err(PyValueError::new_err("an Avro layout needs at least one node"));
        }
        let mut out = Vec::with_capacity(count);
        for (i, (kind, size, children, name)) in nodes.into_iter().enumerate() {
            if kind > RECORD || children.iter().any(|&c| c >= count) {
                return Err(PyValueError::new_err(format!("node {i}: bad kind or child index")));
            }
            let arity_ok = match kind {
                ARRAY | MAP => children.len() == 1,
                UNION | RECORD => true,
                _ => children.is_empty(),
            };
            if !arity_ok {
                return Err(PyValueError::new_err(format!("node {i}: wrong number of children")));
            }
            out.push(Node { kind, size, children, name });
        }
        Ok(Self { nodes: out })
    }

    /// Checks the value that starts at `start` in `data`; returns where it ends, or
    /// (False, message) when the input is malformed and (True, message) when it ends
    /// too early, as a ValueError's arguments.
    fn check(&self, data: &[u8], start: usize) -> PyResult<usize> {
        if start > data.len() {
            return Err(PyValueError::new_err((true, format!("body starts at {start}, past the end"))));
        }
        let mut r = Reader { data, pos: start };
        match self.check_node(&mut r, 0, 0) {
            Ok(()) => Ok(r.pos),
            Err(refusal) => Err(PyValueError::new_err((refusal.truncated, refusal.message))),
        }
    }
}
