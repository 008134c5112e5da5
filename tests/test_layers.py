"""DESIGN: imports point down the pipeline, never up, never in a circle.

Every ``import`` in ``src/fitgraph`` (module level and inside functions: a lazy import is a
dependency too) is read from the source; each module gets the layer of the longest prefix in
``LAYERS``, and an import may only reach its own layer or one below. A package's ``__init__``
may name its own modules (it re-exports them; ``fitgraph.cost`` names the measured cost model
lazily, which the torch-free boundary holds apart: ``test_boundary.py``)."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# NOTE: lowest first. The planning core (graph, the cost interface, plan, transform, sim,
# solvers) under the torch runtime (capture, execute), under the measured cost model (it runs
# ops through the runtime), under measuring and the API, under the tools
LAYERS: list[tuple[str, ...]] = [
    ("fitgraph.units", "fitgraph.graph", "fitgraph.progress"),
    ("fitgraph.cost", "fitgraph.plan"),
    ("fitgraph.transform", "fitgraph.sim"),
    ("fitgraph.solvers",),
    ("fitgraph.dist",),
    ("fitgraph.capture", "fitgraph.execute"),
    ("fitgraph.cost.profiler", "fitgraph.cost.in_situ", "fitgraph.cost.drawn_bits",
     "fitgraph.cost.first_touch", "fitgraph.cost.opaque", "fitgraph.cost.plan_timing"),
    ("fitgraph.measure", "fitgraph.latency_check", "fitgraph.regions_latency",
     "fitgraph.ambient", "fitgraph.python_values", "fitgraph.inspection", "fitgraph.report"),
    ("fitgraph.compile_backend", "fitgraph.regions", "fitgraph.api", "fitgraph.dist.runtime"),
    ("fitgraph", "fitgraph.cli", "fitgraph.cli_bench", "fitgraph.cli_case",
     "fitgraph.cli_optimize", "fitgraph.cli_plan_dist", "fitgraph.dist_script", "fitgraph.zoo",
     "fitgraph.bench"),
]


def modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """module name -> (file, is a package's __init__)."""
    out = {}
    for p in sorted((SRC / "fitgraph").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if init else parts)] = (p, init)
    return out


def imports(mods: dict[str, tuple[pathlib.Path, bool]]) -> dict[str, set[str]]:
    """module -> the fitgraph modules it imports (``from pkg import mod`` names the module)."""
    out: dict[str, set[str]] = {}
    for name, (path, init) in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = name.split(".") if init else name.split(".")[:-1]
                if node.level:
                    base = base[:len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix
                           for a in node.names]
            else:
                continue
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != name and t.startswith("fitgraph"):
                    found.add(t)
        out[name] = found
    return out


def layer(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def test_no_import_points_up_the_pipeline():
    mods = modules()
    up = []
    for a, targets in imports(mods).items():
        for b in sorted(targets):
            if mods[a][1] and b.startswith(a + "."):
                continue   # NOTE: a package re-exporting its own modules
            if layer(b) > layer(a):
                up.append(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})")
    assert not up, "\n".join(up)


def test_no_import_cycle():
    graph = imports(modules())
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [m, t]) if t in path
                              else f"{m} -> {t}")
            elif t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "\n".join(cycles)


def test_every_module_has_a_layer_and_the_checker_sees_imports():
    mods = modules()
    graph = imports(mods)
    for m in mods:
        layer(m)
    # NOTE: the checker reads relative, absolute and lazy (in-function) imports
    assert "fitgraph.graph.ir" in graph["fitgraph.plan.remat"]
    assert "fitgraph.cost.profiler" in graph["fitgraph.cost"]
    assert "fitgraph.execute.executor" in graph["fitgraph.cost.in_situ"]
