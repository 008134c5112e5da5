import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# NOTE: the tests time eager and planned steps as the benchmarks do: freed host memory stays
# mapped (opt-in: execute/host_memory.py)
from fitgraph.execute.host_memory import keep_host_memory  # noqa: E402

keep_host_memory()


@pytest.fixture(autouse=True)
def _one_thread_and_private_cache(tmp_path_factory, monkeypatch):
    # NOTE: one thread: kernels' workspaces and timings depend on the thread count
    torch.set_num_threads(1)
    monkeypatch.setenv("FITGRAPH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
    yield


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test. NOTE: every test that compiles new
    modules needs it; Dynamo's per-code cache limit would otherwise make later compiles fall
    back to eager silently."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def zoo_graphs():
    """(case, captured graph) of each ``helpers.DIM_ZOO`` model: what dimension rules and
    regions are checked on (tests/test_dims.py, tests/test_dim_regions.py)."""
    from helpers import DIM_ZOO

    import fitgraph
    import fitgraph.zoo

    out = {}
    for name, over in DIM_ZOO.items():
        torch.manual_seed(0)
        case = fitgraph.zoo.build(name, "small", **over)
        out[name] = (case, fitgraph.capture(case.model, case.batch, case.loss_fn))
    return out
