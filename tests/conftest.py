import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _one_thread_and_private_cache(tmp_path_factory, monkeypatch):
    # NOTE: one thread: kernels' workspaces and timings depend on the thread count
    torch.set_num_threads(1)
    monkeypatch.setenv("FITGRAPH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
    yield
