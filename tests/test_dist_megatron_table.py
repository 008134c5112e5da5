"""Megatron-LM's Table 1 (the parallel planner's ground truth) as transcribed: each row's shape
gives its published parameter count (the paper's eq. 2), its configuration fits its GPUs and
layers, and its implied iteration time follows eq. 3."""

from __future__ import annotations

import pytest

from fitgraph.dist import TABLE1, GptShape, dgx_a100


@pytest.mark.parametrize("row", TABLE1, ids=lambda r: f"{r.billions:g}B")
def test_each_row_is_consistent(row):
    assert round(row.shape.parameters / 1e9, 1) == pytest.approx(row.billions, abs=0.05)
    assert row.t * row.p * row.dp == row.gpus and row.gpus % 8 == 0
    assert row.shape.layers % row.p == 0 and row.shape.hidden % row.shape.heads == 0
    assert row.batch % row.dp == 0
    assert dgx_a100(row.gpus // 8).devices == row.gpus
    # NOTE: eq. 3 over the published TFLOP/s of every GPU
    assert row.iteration_s * row.tflops_per_gpu * 1e12 * row.gpus == pytest.approx(
        row.shape.flops_per_iteration(row.batch))


def test_eq3_counts_a_second_forward_over_the_six_flops_per_parameter_and_token():
    """Without attention and vocabulary terms eq. 3 is 8 FLOPs per parameter per token (2 of
    the forward, 4 of the backward, 2 of the forward again): 4/3 of the usual 6."""
    g = GptShape(layers=96, hidden=12288, heads=96)
    dense = 96 * g.seq * g.layers * g.hidden ** 2
    assert dense / (g.seq * 12 * g.layers * g.hidden ** 2) == 8
    assert g.flops_per_iteration(1) > dense
