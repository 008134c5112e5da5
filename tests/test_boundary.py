"""DESIGN: graph/, plan/, sim/ and the roofline cost model are plain Python — no torch import."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = [
    "fitgraph.graph.ir", "fitgraph.graph.analysis", "fitgraph.plan.instructions",
    "fitgraph.plan.eager", "fitgraph.plan.verify", "fitgraph.sim.simulate", "fitgraph.sim",
    "fitgraph.cost.base", "fitgraph.cost.devices", "fitgraph.cost.roofline",
    "fitgraph.plan.remat", "fitgraph.solvers", "fitgraph.solvers.candidates", "fitgraph.units",
    "fitgraph.graph.deps", "fitgraph.plan.reorder", "fitgraph.plan.offload",
    "fitgraph.plan.offload_place", "fitgraph.plan.copy_stream", "fitgraph.graph.dims",
    "fitgraph.graph.dim_region", "fitgraph.transform.optimizer_in_backward",
    "fitgraph.solvers.ilp", "fitgraph.solvers.hotspot", "fitgraph.plan.staged",
]

def _import_without_torch(module: str) -> subprocess.CompletedProcess:
    code = f"""
import importlib.abc, sys, types, pathlib
MOD = {module!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported while importing " + MOD)
        return None
sys.meta_path.insert(0, Block())
import importlib.util
spec = importlib.util.find_spec("fitgraph")
pkg = types.ModuleType("fitgraph"); pkg.__path__ = list(spec.submodule_search_locations)
sys.modules["fitgraph"] = pkg  # NOTE: skip fitgraph/__init__, which imports torch on purpose
importlib.import_module(MOD)
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_planning_core_never_imports_torch():
    failures = {}
    for mod in TORCH_FREE:
        r = _import_without_torch(mod)
        if r.returncode != 0:
            failures[mod] = r.stderr.strip().splitlines()[-1]
    assert not failures, failures


def test_probe_detects_torch():
    r = _import_without_torch("fitgraph.capture.tracer")
    assert r.returncode != 0 and "torch imported" in r.stderr
