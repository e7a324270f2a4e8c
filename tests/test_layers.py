"""The layers of kvstream (docs/ARCHITECTURE.md), read from the source: every import from
one of its packages into another (at module level, inside a function or under
``TYPE_CHECKING``) is an edge listed in :data:`ALLOWED`, and the edges form no circle. A
new import across packages fails here until it is added to the table, which is where to
ask whether it runs downward.

A unit is a package of ``kvstream`` (``tools`` with its subpackages) or a top-level
module, except that a package's ``options`` and ``errors`` modules are units of their own:
the option dataclasses ``settings`` derives its sections from, and the exceptions, sit
below the package's other modules (which may always import them), and listing a package
as a dependency admits them too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvstream

ROOT = Path(kvstream.__file__).parent
LEAVES = ("options", "errors")

#: unit → the units it may import, bottom layer first (docs/ARCHITECTURE.md's picture).
ALLOWED: dict[str, set[str]] = {
    # 0: vocabulary, no Kafka, no settings
    "kvstream": set(),  # the package itself: its version
    "_native": set(),
    "logs": set(),
    "options": set(),
    "hashing": {"_native"},
    "engine_model": set(),
    "roles": set(),
    "events": {"_native", "roles"},
    # 1: the router's state and decision
    "router": {"_native", "events", "hashing"},
    # 2: the settings, derived from the option dataclasses of the packages above them
    "replica.options": {"options"},
    "worker.options": {"roles"},
    "gateway.options": {"gateway.errors", "roles"},
    "settings": {"gateway.options", "hashing", "logs", "options", "replica.options", "router", "worker.options"},
    # 3: Kafka
    "kafka": {"logs", "settings"},
    # 4: the two sides of the log, and the emulated engine
    "worker": {"events", "hashing", "kafka", "logs", "roles", "settings"},
    "replica": {"events", "hashing", "kafka", "logs", "options", "roles", "router", "settings"},
    "emulator.errors": {"engine_model"},
    "emulator.options": {"emulator.errors", "engine_model", "roles"},
    "emulator": {"engine_model", "logs", "roles"},
    # 5: the OpenAI gateway, on the replica's facade
    "gateway": {"_native", "events", "logs", "replica", "roles", "router"},
    # 6: what composes them: `kvstream router`, the tools, the `kvstream` command
    "serve": {"gateway", "logs", "replica", "settings"},
    "tools": {"engine_model", "events", "hashing", "kafka", "logs", "replica", "router", "settings", "worker"},
    "cli": {"kafka", "logs"},
}


def module_name(path: Path) -> str:
    parts = ("kvstream", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "kvstream"
    if len(parts) == 2 and parts[1] in LEAVES and (ROOT / parts[0]).is_dir():
        return ".".join(parts)
    return parts[0]


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every kvstream import in the file, wherever it stands."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kvstream":  # `from kvstream import _native`
                for alias in node.names:
                    yield node.lineno, f"kvstream.{alias.name}"
            else:
                yield node.lineno, node.module


def edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) → where, for every import between two units."""
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "_native_src" in path.parts:
            continue
        src = unit(module_name(path))
        for line, target in imports(path):
            if target != "kvstream" and not target.startswith("kvstream."):
                continue
            dst = unit(target)
            if dst != src:
                out.setdefault((src, dst), []).append(f"{path.relative_to(ROOT.parent)}:{line}")
    return out


def allows(src: str, dst: str) -> bool:
    if dst.partition(".")[0] == src:  # a package's own options and errors
        return True
    allowed = ALLOWED.get(src, set())
    return dst in allowed or ("." in dst and dst.partition(".")[0] in allowed)


def test_every_import_between_units_is_a_listed_edge() -> None:
    found = edges()
    assert found, "no imports read: the walk is broken"
    unknown = sorted({src for src, _ in found} - set(ALLOWED) - {f"{p}.{leaf}" for p in ALLOWED for leaf in LEAVES})
    assert not unknown, f"units missing from ALLOWED: {unknown}"
    wrong = {f"{src} → {dst}": where for (src, dst), where in sorted(found.items()) if not allows(src, dst)}
    assert not wrong, f"imports that are not listed edges (runs upward or sideways?): {wrong}"


def test_the_listed_edges_form_no_circle() -> None:
    graph = {src: set(dsts) for src, dsts in ALLOWED.items()}
    for src, dsts in ALLOWED.items():  # a package's options and errors come with it
        graph[src] |= {f"{p}.{leaf}" for p in (src, *dsts) for leaf in LEAVES if f"{p}.{leaf}" in ALLOWED}
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"a circle: {' → '.join((*path[path.index(node):], node))}"
        if node in done:
            return
        for nxt in graph.get(node, ()):
            visit(nxt, (*path, node))
        done.add(node)

    for node in graph:
        visit(node, ())


def test_no_circle_between_modules() -> None:
    """Within a package too: no module imports one that imports it back (directly or
    through others)."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py") if "_native_src" not in p.parts}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        targets = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvstream"):
                # `from kvstream.replica import route_body` imports a module, not a name
                targets |= {resolve(f"{node.module}.{alias.name}") for alias in node.names} - {None, mod}
            elif isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names if a.name.startswith("kvstream")} - {None, mod}
    # Tarjan's strongly connected components: each one of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: set[frozenset[str]] = set()

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.add(frozenset(component))

    for mod in sorted(graph):
        if mod not in index:
            connect(mod)
    assert not circles, f"circles between modules: {[sorted(c) for c in circles]}"
