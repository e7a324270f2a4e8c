"""Strict checking of Avro bodies, as Apache Avro's reference decoders do (DESIGN.md §2).

fastavro's compiled reader, which decodes our bodies fast, accepts what the references
reject: negative enum and union indexes (Python's negative indexing picks a symbol or a
branch), and varints longer than ten bytes or with bits beyond 64 (they wrap). A bit
flip can turn tier DEVICE into EXTERNAL that way. So every body is first walked once by
the compiled ``kvstream._native.AvroLayout`` over the writer schema's layout, which
refuses:

- a varint of more than ten bytes, or whose tenth byte has any bit but the lowest;
- an enum or union index outside ``[0, count)``, negative included;
- a negative ``bytes``/``string`` length, or one longer than the input;
- an ``int`` outside 32 bits, a ``boolean`` byte other than 0 or 1, a string or map key
  that is not UTF-8, nesting deeper than 64 levels (recursive schemas only);

and returns where the value ends. Property tests (tests/events/test_avro_oracle.py)
check the codec against Apache Avro's reference Python decoder on random, bit-flipped
and overwritten bytes.
"""

from __future__ import annotations

from typing import Any

from kvstream._native import AvroLayout

from kvstream.events.errors import DecodeError

# Node kinds, as numbered in kvstream/_native_src/src/avro_check.rs.
KINDS = {
    "null": 0,
    "boolean": 1,
    "int": 2,
    "long": 3,
    "float": 4,
    "double": 5,
    "bytes": 6,
    "string": 7,
    "fixed": 8,
    "enum": 9,
    "array": 10,
    "map": 11,
    "union": 12,
    "record": 13,
}

#: (kind, size, children, name): size is a fixed's byte count or an enum's symbol count.
Node = tuple[int, int, list[int], str]


def layout_nodes(parsed: Any) -> list[Node]:
    """The flat node list of a schema in fastavro's parsed form (node 0 is the root).
    Named types become one node, referenced by index wherever the name recurs."""
    nodes: list[Node] = []
    named: dict[str, int] = {}

    def add(schema: Any) -> int:
        if isinstance(schema, str):
            if schema in named:
                return named[schema]
            if schema not in KINDS:
                raise ValueError(f"unknown Avro type {schema!r}")
            nodes.append((KINDS[schema], 0, [], schema))
            return len(nodes) - 1
        if isinstance(schema, list):
            at = len(nodes)
            nodes.append((KINDS["union"], 0, [], ""))
            children = [add(branch) for branch in schema]
            nodes[at] = (KINDS["union"], 0, children, "[" + ", ".join(nodes[c][3] for c in children) + "]")
            return at
        kind = schema["type"]
        if kind == "error":
            kind = "record"
        if kind not in ("record", "enum", "fixed", "array", "map"):
            return add(kind)  # {"type": "long", "logicalType": ...} and the like
        name = schema.get("name", kind)
        at = len(nodes)
        nodes.append((KINDS[kind], 0, [], name))
        if "name" in schema:
            named[name] = at
        if kind == "record":
            nodes[at] = (KINDS[kind], 0, [add(f["type"]) for f in schema["fields"]], name)
        elif kind == "enum":
            nodes[at] = (KINDS[kind], len(schema["symbols"]), [], name)
        elif kind == "fixed":
            nodes[at] = (KINDS[kind], int(schema["size"]), [], name)
        else:
            nodes[at] = (KINDS[kind], 0, [add(schema["items" if kind == "array" else "values"])], name)
        return at

    add(parsed)
    return nodes


class StrictLayout:
    """Checks bodies written with one writer schema."""

    __slots__ = ("_check", "name")

    def __init__(self, name: str, parsed: Any) -> None:
        self.name = name
        self._check = AvroLayout(layout_nodes(parsed)).check

    def end_of(self, data: bytes, start: int) -> int:
        """Where the value starting at ``start`` ends; DecodeError with the reason if
        the references would refuse it."""
        try:
            return self._check(data, start)
        except ValueError as exc:
            ran_out, message = exc.args
            if ran_out:
                raise DecodeError(f"{self.name} body ends too early: {message}", reason="truncated") from None
            raise DecodeError(f"malformed {self.name} body: {message}") from None
