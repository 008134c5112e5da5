"""``fitgraph bench``: every system side by side on one model, measured in one process.

Systems (``SYSTEMS``): eager PyTorch; ``torch.utils.checkpoint`` around every block
(``checkpoint``); selective activation checkpointing per block (``sac``: matmuls and attention
saved, the rest recomputed, ``sac_policy``); ``torch.autograd.graph.save_on_cpu`` (CUDA only:
on a CPU run the "host" is the same RAM, so it is a row with that reason, not a measurement);
torch.compile with ``activation_memory_budget`` at each budget under ``aot_eager`` and
``inductor``, each variant compiled fresh (a reused code object would keep the first budget);
the classic planners as fitgraph solvers at each budget (``dtr``, ``rotor``, ``checkmate``:
Checkmate's MILP, solver ``ilp``, with its own time limit); fitgraph at each budget (solver
``auto`` unless told) and at each other system's measured peak. Each gets its own copy of the
model and an AdamW, is warmed up (compile / solve time recorded), measured once under the
MemoryMeter, then timed in interleaved rounds (the order rotates each round), each of its
steps between two eager steps; a system's step time is eager's median times the median of its
step / the mean of the eager steps around it (``_time_rounds``). A system that fails is
recorded with its error, not dropped.

Example:
    >>> from fitgraph.bench.harness import BenchRow
    >>> BenchRow("m", "eager", None, 1, 0.5).overhead(0.5)
    0.0
"""

from __future__ import annotations

import copy
import functools
import inspect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..capture.calling import compute_loss
from ..execute.host_memory import keep_host_memory
from ..execute.meter import MemoryMeter
from ..measure import resident_bytes

__all__ = ["COMPILERS", "FITGRAPHS", "PLANNERS", "SAVE_ON_CPU_ON_CPU", "SYSTEMS", "BenchRow",
           "bench_model", "checkpointed", "paired_ratio", "sac_policy"]

# NOTE: the order rows come in; eager always runs (every overhead is against it)
SYSTEMS = ("eager", "checkpoint", "sac", "save_on_cpu", "fitgraph", "dtr", "rotor", "checkmate",
           "compile_aot_eager", "compile_inductor", "fitgraph_inductor")
# NOTE: fitgraph's own systems: the whole step planned and run by its executor, and its plan as
# inductor's partitioner (``fitgraph.backend(inner="inductor")``: fused kernels, the optimizer
# eager, as the torch.compile peers run it)
FITGRAPHS = ("fitgraph", "fitgraph_inductor")
COMPILERS = {"compile_aot_eager": "aot_eager", "compile_inductor": "inductor"}
PLANNERS = {"fitgraph": None, "dtr": "dtr", "rotor": "rotor", "checkmate": "ilp"}  # None: solver=
SAVE_ON_CPU_ON_CPU = "save_on_cpu offloads to host memory, which is the same RAM on a CPU run"
SAC_SAVED = frozenset({"mm", "addmm", "bmm", "baddbmm", "linear"})  # aten ops whose outputs sac keeps
SAC_SAVED_PREFIX = "_scaled_dot_product_"   # attention: every SDPA kernel
ERROR_LINES = 3      # NOTE: an error's first lines ("backend='inductor' raised:" says little alone)
ERROR_CHARS = 300


@dataclass
class BenchRow:
    model: str
    system: str                  # one of SYSTEMS
    budget: float | None         # fraction of the eager peak asked for
    peak_bytes: int | None       # measured: resident + allocator peak
    step_s: float | None         # median measured step time
    prepare_s: float = 0.0       # warm-up wall time (compile, or capture + profile + solve; 2
    #                              steps), or until the error
    error: str = ""
    matched: str = ""            # fitgraph asked for these peers' measured peak (", "-separated)
    solve_s: float | None = None  # the solver's own time (fitgraph's solvers)
    notes: str = ""              # solver notes: auto's winner, checkmate's optimality / gap
    spread: float | None = None  # (max - min) / median of the timed steps

    def overhead(self, eager_s: float) -> float | None:
        return None if self.step_s is None else self.step_s / eager_s - 1

    def as_dict(self) -> dict:
        return asdict(self)


class NotApplicable(Exception):
    """A system that does not apply on this run; its message is the row's error, verbatim."""


def sac_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: keep matmul and attention outputs (costly to redo),
    recompute the rest (cheap elementwise ops, norms, softmax)."""
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(getattr(op, "overloadpacket", None), "__name__", str(op))
    if name in SAC_SAVED or name.startswith(SAC_SAVED_PREFIX):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def sac_context_fn():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(sac_policy)


def checkpointed(model: torch.nn.Module, block_types: tuple[type, ...],
                 context_fn: Callable | None = None) -> torch.nn.Module:
    """A copy of ``model`` whose every module of ``block_types`` (the root excluded) runs its
    forward under ``torch.utils.checkpoint`` (non-reentrant, as PyTorch recommends);
    ``context_fn``: e.g. ``sac_context_fn`` for selective activation checkpointing.

    NOTE: the forward is replaced on the instance, not the module wrapped: a parent may read
    the block's attributes (``nn.TransformerEncoder`` reads ``layers[0].self_attn``)."""
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    model = copy.deepcopy(model)
    for name, mod in list(model.named_modules()):
        if name and isinstance(mod, block_types):
            mod.forward = functools.partial(checkpoint, mod.forward, use_reentrant=False,
                                            context_fn=context_fn or noop_context_fn)
    return model


@dataclass
class _System:
    name: str
    budget: float | None
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], object]
    prepare_s: float = 0.0
    peak: int | None = None
    times: list | None = None
    error: str = ""
    ratios: list | None = None    # step time / the mean of the eager steps around it
    faults: list | None = None    # minor page faults of each timed step (empty: not counted)
    matched: str = ""
    solve_s: float | None = None
    notes: str = ""

    @property
    def label(self) -> str:
        return self.name if self.budget is None else f"{self.name} {self.budget:g}"


def _eager_step(model, batch, loss_fn, opt) -> Callable[[], object]:
    def step():
        loss = compute_loss(model, batch, loss_fn)
        loss.backward()
        opt.step()
        return loss
    return step


def _copied(model, optimizer):
    """(a deep copy of ``model``, an optimizer of the same type over it holding ``optimizer``'s
    state and settings; None without one).

    NOTE: defaults may hold keys the constructor does not take (AdamW's
    decoupled_weight_decay in torch 2.13): the state dict restores every one of them."""
    m = copy.deepcopy(model)
    if optimizer is None:
        return m, None
    takes = inspect.signature(type(optimizer)).parameters
    o = type(optimizer)(m.parameters(),
                        **{k: v for k, v in optimizer.defaults.items() if k in takes})
    # NOTE: load_state_dict keeps the very state tensors it is given: without a copy both
    # optimizers would step one AdamW state
    o.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return m, o


def _save_on_cpu_step(model, batch, loss_fn, opt) -> Callable[[], object]:
    if _device(model).type != "cuda":
        raise NotApplicable(SAVE_ON_CPU_ON_CPU)

    def step():
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            loss = compute_loss(model, batch, loss_fn)
        loss.backward()  # NOTE: the unpack hooks were set when saving: copies come back here
        opt.step()
        return loss
    return step


def error_text(e: BaseException) -> str:
    """``Type: message``: the message's first lines, verbatim, joined by " / "."""
    if isinstance(e, NotApplicable):
        return str(e)
    lines = [s.strip() for s in str(e).splitlines() if s.strip()][:ERROR_LINES]
    return f"{type(e).__name__}: {' / '.join(lines)}"[:ERROR_CHARS]


def bench_model(case, budgets: list[float], *, systems: Sequence[str] | None = None,
                repeats: int = 5, time_budget: float = 30.0, checkmate_time_limit: float = 60.0,
                match_peers: bool = True, solver: str = "auto",
                progress: Callable[[str], None] = print) -> list[BenchRow]:
    """Measure the ``systems`` (default: all of ``SYSTEMS``; eager always) on one zoo case; rows
    in a fixed order. ``match_peers``: fitgraph also plans for each other system's measured peak
    (in bytes), so the rows answer "at the peer's memory, which is faster" directly
    (``verdicts``). ``solver``: fitgraph's solver; ``time_budget``: its (and dtr's, rotor's)
    time; ``checkmate_time_limit``: the MILP's."""
    from ..api import optimize

    chosen = set(SYSTEMS if systems is None else systems) | {"eager"}
    unknown = sorted(chosen - set(SYSTEMS))
    if unknown:
        raise ValueError(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    out: list[_System] = []
    batch, loss_fn = case.batch, case.loss_fn
    device = _device(case.model)

    def add(name, budget, model, make_step, matched=""):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        s = _System(name, budget, model, opt, lambda: None, matched=matched)
        t0 = time.perf_counter()
        try:
            s.step = make_step(model, opt)
            opt.zero_grad(set_to_none=True)
            s.step()   # NOTE: warm-up: compiles, creates optimizer state, plans
            opt.zero_grad(set_to_none=True)
            s.step()
            s.prepare_s = time.perf_counter() - t0
            plan_info = getattr(s.step, "solution", None)
            if plan_info is not None:
                s.solve_s, s.notes = plan_info.solve_s, solution_notes(plan_info)
        except Exception as e:  # NOTE: a failing peer is a result, recorded with its error
            s.error = error_text(e)
            s.prepare_s = time.perf_counter() - t0  # NOTE: what finding out cost (a time limit)
        out.append(s)
        what = f"@ {matched}" if matched else s.label
        progress(f"  {case.name}: {what}: " + (f"error: {s.error}" if s.error
                                                else f"ready in {s.prepare_s:.1f} s"))
        return s

    def planned(planner: str, budget):
        name = PLANNERS[planner] or solver
        limit = checkmate_time_limit if planner == "checkmate" else time_budget
        return lambda m, o: _fitgraph_step(m, batch, loss_fn, o, budget, limit, optimize, name)

    eager = add("eager", None, copy.deepcopy(case.model),
                lambda m, o: _eager_step(m, batch, loss_fn, o))
    if "checkpoint" in chosen:
        add("checkpoint", None, checkpointed(case.model, case.block_types),
            lambda m, o: _eager_step(m, batch, loss_fn, o))
    if "sac" in chosen:
        add("sac", None, checkpointed(case.model, case.block_types, sac_context_fn),
            lambda m, o: _eager_step(m, batch, loss_fn, o))
    if "save_on_cpu" in chosen:
        add("save_on_cpu", None, copy.deepcopy(case.model),
            lambda m, o: _save_on_cpu_step(m, batch, loss_fn, o))
    peers = [s for s in out if not s.error]
    _measure_memory(peers, batch, device)  # NOTE: first, so fitgraph can be asked for their peaks
    planners = [add(p, b, copy.deepcopy(case.model), planned(p, b))
                for p in PLANNERS if p in chosen for b in budgets]
    _measure_memory([s for s in planners if not s.error], batch, device)
    compiled: list[_System] = []
    for name, backend in COMPILERS.items():
        if name not in chosen:
            continue
        for b in budgets:
            # NOTE: each variant is compiled fresh (dynamo reset) and measured at once, timed
            # against eager in its own interleaved rounds, and never called again: after the
            # next reset it would silently recompile with the default budget
            torch._dynamo.reset()
            variant = add(name, b, copy.deepcopy(case.model),
                          lambda m, o, b=b, backend=backend: _compiled_step(m, batch, loss_fn, o,
                                                                           b, backend))
            compiled.append(variant)
            if not variant.error:
                progress(f"  {case.name}: {variant.label}: measuring")
                _measure_memory([variant], batch, device)
                _time_rounds([variant], repeats, device, reference=eager)
        torch._dynamo.reset()
    if "fitgraph_inductor" in chosen:
        # NOTE: at each budget (a fraction of the compiled graph's simulated eager peak), then
        # at each inductor peer's measured peak: the backend plans forward + backward, so the
        # optimizer state (which the step's peak holds) comes off the bytes it is given
        peers_ind = [s for s in compiled if s.name == "compile_inductor" and not s.error
                     and s.peak] if match_peers else []
        for b in budgets:
            compiled.append(_fitgraph_inductor(add, case, b, b, "", batch, loss_fn,
                                               time_budget, repeats, device, eager))
        for p in peers_ind:
            compiled += _fitgraph_inductor_at(add, case, p, batch, loss_fn, time_budget,
                                              repeats, device, eager)
        torch._dynamo.reset()
    plain = [s for s in out if not s.error and s not in compiled]
    if match_peers and eager.peak and "fitgraph" in chosen:
        by_peak: dict[int, _System] = {}
        for peer in [s for s in out if s.name not in ("eager", *FITGRAPHS) and not s.error
                     and s.peak]:
            if peer.peak in by_peak:  # NOTE: the same bytes asked twice would be the same plan
                by_peak[peer.peak].matched += f", {peer.label}"
                continue
            by_peak[peer.peak] = add("fitgraph", peer.peak / eager.peak, copy.deepcopy(case.model),
                                     planned("fitgraph", int(peer.peak)), matched=peer.label)
            if not by_peak[peer.peak].error:
                plain.append(by_peak[peer.peak])
    progress(f"  {case.name}: {len(plain)} systems: memory, then {repeats} interleaved rounds")
    _measure_memory(plain, batch, device)
    _time_rounds(plain, repeats, device, reference=eager)
    eager_s = statistics.median(eager.times) if eager.times else None

    def step_s(s: _System) -> float | None:
        if not s.times:
            return None
        if s is not eager and s.ratios and eager_s is not None:
            return statistics.median(s.ratios) * eager_s  # NOTE: on the final eager time
        return statistics.median(s.times)

    def spread(s: _System) -> float | None:
        return (max(s.times) - min(s.times)) / statistics.median(s.times) if s.times else None

    return [BenchRow(case.name, s.name, s.budget, s.peak, step_s(s), s.prepare_s, s.error,
                     s.matched, s.solve_s, s.notes, spread(s)) for s in out]


def paired_ratio(times: list[float], eager_times: list[float]) -> float:
    """The median over rounds of a system's step time / eager's in the same round. NOTE: this
    machine's speed drifts by tens of percent over minutes (shared cores, clocks); within one
    round both ran within seconds, so the per-round ratio cancels the drift that a ratio of two
    medians keeps.

    Example:
        >>> paired_ratio([1.1, 2.2, 1.1], [1.0, 2.0, 1.0])
        1.1
    """
    return statistics.median(t / e for t, e in zip(times, eager_times))


def solution_notes(sol) -> str:
    """What a solver says about its plan, in a few words: auto's winner, an exact solver's
    optimality (or that it stopped at its time limit, with the proven gap), the recomputes."""
    parts = []
    if "winner" in sol.notes:
        parts.append(f"winner {sol.notes['winner']}")
    if sol.optimal is True:
        parts.append("optimal")
    elif sol.optimal is False:
        status = sol.notes.get("status", "not proven optimal")
        gap = "" if sol.gap is None else f", gap {sol.gap:.1%}"
        parts.append(f"{status}{gap}")
    recomputes = sol.plan.counts().get("recompute", 0)
    parts.append(f"{recomputes} recomputes")
    return "; ".join(parts)


def _device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _measure_memory(systems: list[_System], batch, device=None) -> None:
    for s in systems:
        s.optimizer.zero_grad(set_to_none=True)
        before = resident_bytes(s.model, batch, s.optimizer)
        with MemoryMeter(device) as meter:
            s.step()
        s.peak = before + meter.peak_bytes


def _minor_faults() -> int | None:
    """This process's minor page faults so far (None where the OS does not say)."""
    try:
        import resource
    except ImportError:  # NOTE: not on Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time_rounds(systems: list[_System], repeats: int, device=None,
                 reference: _System | None = None) -> None:
    """Time each system ``repeats`` times, in rounds whose order rotates. With a
    ``reference`` (eager), each system's step runs between two reference steps and
    ``ratios`` gets its time over their mean. NOTE: with thirty systems a round lasts tens of
    seconds and this machine's speed drifts within that; a bracket is two seconds wide, so
    the ratio cancels the drift that a once-per-round reference keeps (ViT in the first
    report: the same plan measured 20% apart as two systems)."""
    # NOTE: every system, eager PyTorch included, times with freed host memory kept mapped
    # (execute/host_memory.py): otherwise glibc's adaptive thresholds fault pages in for
    # whichever system's allocation order happens to trip them
    keep_host_memory()
    others = [s for s in systems if s is not reference]
    for s in others:
        s.times, s.ratios, s.faults = [], [], []
    if reference is not None:
        reference.times, reference.faults = [], []

    def timed(s: _System) -> float:
        s.optimizer.zero_grad(set_to_none=True)
        _sync(device)
        f0 = _minor_faults()
        t0 = time.perf_counter()
        s.step()
        _sync(device)
        t = time.perf_counter() - t0
        if f0 is not None:
            s.faults.append(_minor_faults() - f0)
        return t

    before = timed(reference) if reference is not None else None
    if before is not None:
        reference.times.append(before)
    for r in range(repeats):
        k = r % max(len(others), 1)
        for s in others[k:] + others[:k]:
            t = timed(s)
            s.times.append(t)
            if reference is not None:
                after = timed(reference)
                reference.times.append(after)
                s.ratios.append(t / ((before + after) / 2))
                before = after


def _compiled_step(model, batch, loss_fn, opt, budget: float, backend: str = "aot_eager"):
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()  # NOTE: compile fresh: a cached graph would keep an earlier budget
    compiled = torch.compile(model, backend=backend)
    first = [True]

    def step():
        if first[0]:  # NOTE: the budget is read when the first call compiles (both graphs)
            with functorch_config.patch(activation_memory_budget=budget):
                loss = compute_loss(compiled, batch, loss_fn)
                loss.backward()
            first[0] = False
        else:
            loss = compute_loss(compiled, batch, loss_fn)
            loss.backward()
        opt.step()
        return loss
    return step


INDUCTOR_RETRIES = 2   # NOTE: re-plans when inductor's step measures off the peer's peak
# NOTE: a try that measures more than this share under the peer's peak leaves bytes unused that
# could buy speed (U-Net at inductor's 0.9 peak: planned for 83.3 MiB less the AdamW state, it
# measured 66.6 MiB): it is planned again with that slack on
INDUCTOR_SLACK = 0.05
# NOTE: a try over the peak is planned again with the excess off and this share of the peak
# more: inductor's bytes over the plan's vary by a few MiB from one plan to the next (Llama at
# inductor's 0.9 peak, 382.7 MiB: planned 310.5 / 262.0 / 260.0 MiB, measured 433.6 / 384.8 /
# 386.9 MiB), so taking off just the excess can stay over the peak try after try
INDUCTOR_MARGIN = 0.02


def _fitgraph_inductor(add, case, shown: float, asked, matched: str, batch, loss_fn,
                       time_budget: float, repeats: int, device, eager) -> _System:
    """One ``fitgraph_inductor`` row: compiled fresh for ``asked`` (a fraction or bytes of the
    compiled graph), measured, timed against eager in its own rounds."""
    variant = add("fitgraph_inductor", shown, copy.deepcopy(case.model),
                  lambda m, o: _fitgraph_compiled_step(m, batch, loss_fn, o, asked, time_budget),
                  matched=matched)
    if not variant.error:
        _measure_memory([variant], batch, device)
        _time_rounds([variant], repeats, device, reference=eager)
    return variant


def _fitgraph_inductor_at(add, case, peer: _System, batch, loss_fn, time_budget: float,
                          repeats: int, device, eager) -> list[_System]:
    """``fitgraph_inductor`` at ``peer``'s measured peak: planned for those bytes less the
    optimizer state. Inductor's kernels allocate otherwise than the ATen plan, so the bytes
    asked are calibrated on what the step measures: a try over the peak is planned again with
    the excess and ``INDUCTOR_MARGIN`` of the peak off, one more than ``INDUCTOR_SLACK`` under
    it with the slack on, at most ``INDUCTOR_RETRIES`` times. Every try is a row (its notes say how it was asked); those
    within the peak are matched to the peer, and the verdict takes the fastest of them
    (``verdicts.fitgraph_at``)."""
    asked = int(peer.peak - _state_bytes(peer.optimizer))
    rows = []
    for attempt in range(INDUCTOR_RETRIES + 1):
        row = _fitgraph_inductor(add, case, peer.peak / eager.peak, asked, peer.label, batch,
                                 loss_fn, time_budget, repeats, device, eager)
        row.notes = f"planned for {asked / 2**20:.1f} MiB (try {attempt + 1})"
        rows.append(row)
        if row.error:
            break
        slack = peer.peak - row.peak
        if slack < 0:
            row.matched = ""   # NOTE: over the peak: a row of its own, not the peer's match
            asked += slack - int(INDUCTOR_MARGIN * peer.peak)
        elif slack > INDUCTOR_SLACK * peer.peak:
            asked += slack
        else:
            break
    return rows


def _state_bytes(optimizer) -> int:
    return sum(v.untyped_storage().nbytes() for st in optimizer.state.values()
               for v in st.values() if isinstance(v, torch.Tensor))


def _fitgraph_compiled_step(model, batch, loss_fn, opt, budget, time_budget: float):
    from ..compile_backend import backend

    torch._dynamo.reset()  # NOTE: compile fresh: a cached graph would keep an earlier plan
    be = backend(budget=budget, inner="inductor", time_budget=time_budget)
    return _eager_step(torch.compile(model, backend=be), batch, loss_fn, opt)


def _fitgraph_step(model, batch, loss_fn, opt, budget: float | None, time_budget: float,
                   optimize, solver: str, **options):
    """``optimize``'s step after one eager step (``options``: more of its arguments), with its
    solution on it."""
    # NOTE: one eager step first so AdamW state exists and the plan is the steady-state one
    _eager_step(model, batch, loss_fn, opt)()
    opt.zero_grad(set_to_none=True)
    train_step = optimize(model, batch, loss_fn, opt, budget=budget, time_budget=time_budget,
                          solver=solver, **options)

    def step():
        return train_step(batch)
    step.solution = train_step.plan_for(batch).solution  # NOTE: solve time, optimality, notes
    return step
