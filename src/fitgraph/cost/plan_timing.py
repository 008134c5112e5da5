"""Plans timed against each other on this machine: a whole step of each, through the executor,
on synthetic inputs (no state of a user's model is touched), in paired rounds.

A simulated step time adds up op times measured one by one; the interpreter between ops,
the allocator, caches a split or a recompute leaves cold land on the measured step alone.
``paired`` runs two steps in alternating order and takes the median of their ratios, more
rounds while they are unsettled; ``plans_ratio`` pairs two plans (of one graph or of two
graphs computing the same step: a rewrite, fission's split). ``latency_check`` times a plan
against the eager plan with these; a solver that chooses between plans on simulated times
within a few percent confirms the choice with ``ProfiledCostModel.measured_ratio``.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost.profiler import ProfiledCostModel
    >>> from fitgraph.cost.plan_timing import plans_ratio
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
    >>> g = fitgraph.capture(model, torch.randn(32, 64), lambda m, b: m(b).sum())
    >>> cm = ProfiledCostModel("cpu", progress=False)
    >>> ratio, spread = plans_ratio(g, fitgraph.eager_plan(g), g, fitgraph.eager_plan(g), cm)
    >>> 0.5 < ratio < 2.0
    True
"""

from __future__ import annotations

import statistics
import time

import torch

from ..graph.ir import Graph
from ..plan.instructions import Plan

__all__ = ["MAX_ROUNDS", "ROUNDS", "SETTLED", "WARMUP", "paired", "plans_ratio", "runner",
           "timed_step"]

# NOTE: paired rounds per measurement: the median of 7 ratios moves by a point or two here
ROUNDS = 7
# NOTE: more rounds, up to MAX_ROUNDS, while the ratios' interquartile range is over SETTLED of
# their median: the median of 7 noisy rounds can be a few percent off, the limit's whole margin
MAX_ROUNDS = 21
SETTLED = 0.04
WARMUP = 1


def runner(graph: Graph, cm):
    from ..execute.synthetic import SyntheticRunner

    return SyntheticRunner(graph, cm.device, cm._graph_facts(graph)[1])


def timed_step(ex, runner, graph: Graph, real: dict | None = None) -> float:
    """Seconds of one step of ``ex`` on fresh synthetic inputs (``real``'s where given): what
    the executor does in a user's step, the binding checks, the env's set-up and release and
    the write-back included (``Executor.run_bound``).

    NOTE: around the plan itself the executor checks and binds every input, writes each
    gradient and state back and drops the env: ~1 ms a step on T5 (750 inputs), 0.65% of
    it, which the user's step pays and a check that timed the plan alone read under."""
    from ..execute.executor import check_bound
    from ..execute.synthetic import no_subnormals

    env = runner.values(graph.inputs)
    for vid, t in (real or {}).items():
        env[vid] = t
    inputs = [env[v] for v in graph.inputs]
    # NOTE: the model and the optimizer hold these in a user's step: only the step's own
    # values are freed at its end
    held = list(inputs)
    del env
    specs, sink = ex.input_specs, {}
    outputs = list(graph.outputs.items())

    def write_back() -> None:
        env = ex.env
        for key, vid in outputs:
            sink[key.partition(":")[2]] = env[vid]

    if cm_sync := getattr(runner.device, "type", "cpu") == "cuda":
        torch.cuda.synchronize()
    # NOTE: a whole step on synthetic inputs makes subnormal floats a real batch does not
    # (``execute.synthetic.no_subnormals``): timed with them, Gemma-2's eager plan read 2.2x
    # eager PyTorch on the real batch, 1.0x with them flushed
    with no_subnormals():
        t0 = time.perf_counter()
        check_bound(specs, inputs)
        loss = ex.run_bound(inputs, write_back)
        if cm_sync:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    # NOTE: the loss, gradients and state outlive a user's step (their .grad, the optimizer)
    del loss, held
    sink.clear()
    return dt


def _unsettled(ratios: list[float]) -> bool:
    """Whether the middle half of the ratios spans more than ``SETTLED``: a busy machine
    (another process, frequency changes) spreads single rounds by tens of percent."""
    q = statistics.quantiles(ratios, n=4)
    return (q[2] - q[0]) / statistics.median(ratios) > SETTLED


def paired(timed, reference, rounds: int = ROUNDS, warmup: int = WARMUP,
           reference_offset_s: float = 0.0, undecided=None) -> tuple[float, float]:
    """(median, spread) of ``timed()`` over ``reference()`` (each returns its seconds) in
    ``rounds`` paired rounds after ``warmup``, more while they are unsettled (``_unsettled``)
    or ``undecided(median)`` says the median is too close to call, up to ``MAX_ROUNDS``: the
    reference first, then the other order (neither always runs on the other's warm caches);
    spread = (max - min) / median of the ratios.
    ``reference_offset_s`` is taken off each reference time (at most half of it).

    Example:
        >>> ratio, spread = paired(lambda: 2.0, lambda: 1.0, rounds=3)
        >>> ratio, spread
        (2.0, 0.0)
    """
    runs = (("ref", reference), ("timed", timed))
    ratios: list[float] = []
    r = 0
    while r < warmup + rounds or (r < warmup + MAX_ROUNDS and (
            _unsettled(ratios) or (undecided is not None
                                   and undecided(statistics.median(ratios))))):
        order = runs if r % 2 == 0 else runs[::-1]
        r += 1
        t = {name: fn() for name, fn in order}
        if r > warmup:
            ratios.append(t["timed"] / max(t["ref"] - reference_offset_s, t["ref"] / 2))
    med = statistics.median(ratios)
    return med, (max(ratios) - min(ratios)) / med


def plans_ratio(graph: Graph, plan: Plan, other_graph: Graph, other_plan: Plan, cm,
                rounds: int = ROUNDS, warmup: int = WARMUP, other_offset_s: float = 0.0,
                real: dict | None = None, other_real: dict | None = None,
                undecided=None) -> tuple[float, float]:
    """(median, spread) of ``plan``'s step on ``graph`` over ``other_plan``'s on
    ``other_graph`` (``paired``; ``other_offset_s`` taken off each of the other's times), each
    step on fresh synthetic inputs (``real``'s / ``other_real``'s tensors, by input id, where
    given); ``cm``: a ``ProfiledCostModel``, whose device and input facts make them."""
    from ..execute.executor import Executor

    a, b = Executor(graph, plan, model=None), Executor(other_graph, other_plan, model=None)
    run_a, run_b = runner(graph, cm), runner(other_graph, cm)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return paired(lambda: timed_step(a, run_a, graph, real),
                      lambda: timed_step(b, run_b, other_graph, other_real), rounds, warmup,
                      other_offset_s, undecided)
