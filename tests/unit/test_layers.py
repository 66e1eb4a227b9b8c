"""cluster/'s import graph, read with ast (module-level and function-level imports; not those
under `if TYPE_CHECKING:`, which never run): no import circle, and every import points down
the layers below or stays within its own layer. `python tests/unit/test_layers.py` prints the
layers and which layers each one imports, for the architecture notes."""

from __future__ import annotations

import ast
import fnmatch
import sys
from collections import defaultdict
from pathlib import Path

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"

# Lowest first. A module may import its own layer and those below it. Patterns are fnmatch'ed
# against dotted module names; every module under cluster/ must match exactly one layer.
LAYERS: list[tuple[str, list[str]]] = [
    ("plain values", ["cluster.config", "cluster.app_config", "cluster.metrics", "cluster.sampling_params",
                      "cluster.structured_output"]),
    ("models", ["cluster.models", "cluster.models.*"]),
    ("engine", ["cluster.engine", "cluster.engine.*"]),
    ("kv transfer: errors, wire format, hand-off types", ["cluster.kvtransfer", "cluster.kvtransfer.errors",
                                                         "cluster.kvtransfer.handoff", "cluster.kvtransfer.wire",
                                                         "cluster.kvtransfer.mailbox",
                                                         "cluster.kvtransfer.rendezvous"]),
    ("kv transfer: the connector contract", ["cluster.kvtransfer.base"]),
    ("kv transfer: connectors", ["cluster.kvtransfer.shared_store", "cluster.kvtransfer.tcp",
                                 "cluster.kvtransfer.collective"]),
    ("kv transfer: the connector registry", ["cluster.kvtransfer.connectors"]),
    ("shared by the pools and the router", ["cluster.cache_report", "cluster.stats_board", "cluster.cpu_binding",
                                            "cluster.autoscaling", "cluster.pool_replica"]),
    ("pools", ["cluster.prefill", "cluster.prefill.*", "cluster.decode", "cluster.decode.*"]),
    ("router", ["cluster.router", "cluster.router.*"]),
    ("offline API and tools", ["cluster.llm", "cluster.serve_config", "cluster.loadgen", "cluster.plots",
                               "cluster.bench_cli", "cluster.goodput", "cluster.sharegpt"]),
    ("command line and package", ["cluster.cli", "cluster"]),
]

# Within a layer, these sit side by side: neither imports the other (what both need lives below).
PEERS = [("cluster.prefill", "cluster.decode")]

def module_name(path: Path) -> str:
    parts = list(path.relative_to(CLUSTER.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(CLUSTER.rglob("*.py"))}


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level or in a function, not under
    `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """module → the cluster modules it imports (`from pkg import mod` names the submodule)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets.update(submodules)
            if len(submodules) < len(node.names):
                targets.add(base)
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def layer_of(name: str) -> int:
    hits = [i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    assert len(hits) == 1, f"{name} matches {len(hits)} layers: {[LAYERS[i][0] for i in hits]}"
    return hits[0]


def peer_group(name: str) -> str | None:
    return next((root for pair in PEERS for root in pair if name == root or name.startswith(root + ".")), None)


def bad_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """(importer, imported) → why it breaks the layering."""
    bad = {}
    for src, targets in graph.items():
        for dst in targets:
            if layer_of(dst) > layer_of(src):
                bad[(src, dst)] = f"upward: {LAYERS[layer_of(src)][0]} → {LAYERS[layer_of(dst)][0]}"
            elif (peer_group(src) and peer_group(dst) and peer_group(src) != peer_group(dst)
                  and any({peer_group(src), peer_group(dst)} == set(pair) for pair in PEERS)):
                bad[(src, dst)] = f"sideways between peers {peer_group(src)} and {peer_group(dst)}"
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def describe(edges: dict[tuple[str, str], str]) -> str:
    return "\n".join(f"  {src} → {dst}  ({why})" for (src, dst), why in sorted(edges.items()))


def test_every_module_has_exactly_one_layer():
    for name in modules():
        layer_of(name)


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join("  " + " ↔ ".join(c) for c in found)


def test_imports_point_down_the_layers():
    bad = bad_edges(import_graph())
    assert not bad, "imports against the layers:\n" + describe(bad)


def layer_report() -> str:
    graph = import_graph()
    members: dict[int, list[str]] = defaultdict(list)
    for name in modules():
        members[layer_of(name)].append(name)
    uses: dict[int, set[int]] = defaultdict(set)
    for src, targets in graph.items():
        uses[layer_of(src)].update(layer_of(dst) for dst in targets if layer_of(dst) != layer_of(src))
    lines = ["Layers of cluster/, lowest first (a module imports its own layer and those below):", ""]
    for i in range(len(LAYERS) - 1, -1, -1):
        label = LAYERS[i][0]
        below = ", ".join(LAYERS[j][0] for j in sorted(uses[i], reverse=True)) or "nothing of ours"
        lines.append(f"{i:2d}. {label}  →  {below}")
        lines.append("      " + " ".join(m.removeprefix("cluster.") or "cluster" for m in sorted(members[i])))
    bad = bad_edges(graph)
    lines += ["", "Edges against the layers:" if bad else "No edge against the layers.", describe(bad)]
    found = cycles(graph)
    lines += ["Import circles: " + ("; ".join(" ↔ ".join(c) for c in found) if found else "none")]
    return "\n".join(line for line in lines if line != "")


if __name__ == "__main__":
    print(layer_report())
