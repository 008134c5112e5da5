"""``fitgraph bench``: every system side by side on one model, measured in one process.

Systems: eager PyTorch; ``torch.utils.checkpoint`` around every block; torch.compile (aot_eager)
with ``activation_memory_budget`` at each budget, compiled fresh (a reused code object would keep
the first budget); fitgraph at each budget (solver ``auto`` unless told: hotspot, and fission
where it wins). Each gets its own copy of the model and an AdamW, is
warmed up (compile / solve time recorded), measured once under the MemoryMeter, then timed in
interleaved rounds (the order rotates each round, so machine noise hits all alike); medians.
A system that fails is recorded with its error, not dropped.

Example:
    >>> from fitgraph.bench.harness import BenchRow
    >>> BenchRow("m", "eager", None, 1, 0.5).overhead(0.5)
    0.0
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..capture.calling import compute_loss
from ..execute.meter import MemoryMeter
from ..measure import resident_bytes

__all__ = ["BenchRow", "bench_model", "checkpointed", "verdicts"]


@dataclass
class BenchRow:
    model: str
    system: str                  # eager | checkpoint_blocks | compile_aot_eager | fitgraph
    budget: float | None         # fraction of the eager peak asked for
    peak_bytes: int | None       # measured: resident + allocator peak
    step_s: float | None         # median measured step time
    prepare_s: float = 0.0       # compile time (torch.compile) or solve time (fitgraph)
    error: str = ""
    matched: str = ""            # fitgraph asked for this peer's measured peak (its budget)

    def overhead(self, eager_s: float) -> float | None:
        return None if self.step_s is None else self.step_s / eager_s - 1

    def as_dict(self) -> dict:
        return asdict(self)


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def checkpointed(model: torch.nn.Module, block_types: tuple[type, ...]) -> torch.nn.Module:
    """A copy of ``model`` with every module of ``block_types`` wrapped in
    ``torch.utils.checkpoint`` (non-reentrant, as PyTorch recommends)."""
    model = copy.deepcopy(model)
    for _name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, block_types):
                setattr(mod, child_name, _Checkpointed(child))
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
    ratio_to_eager: float | None = None  # compile variants: timed against eager in their phase
    matched: str = ""


def _eager_step(model, batch, loss_fn, opt) -> Callable[[], object]:
    def step():
        loss = compute_loss(model, batch, loss_fn)
        loss.backward()
        opt.step()
        return loss
    return step


def bench_model(case, budgets: list[float], *, repeats: int = 5, compile: bool = True,
                time_budget: float = 30.0, match_peers: bool = True, solver: str = "auto",
                progress: Callable[[str], None] = print) -> list[BenchRow]:
    """Measure every system on one zoo case; rows in a fixed order. ``match_peers``: fitgraph
    also plans for each peer's measured peak (in bytes), so the rows answer "at the peer's
    memory, which is faster" directly (``verdicts``). ``solver``: fitgraph's solver."""
    from ..api import optimize

    systems: list[_System] = []

    def add(name, budget, model, make_step, matched=""):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sys_ = _System(name, budget, model, opt, lambda: None)
        sys_.matched = matched
        try:
            t0 = time.perf_counter()
            sys_.step = make_step(model, opt)
            opt.zero_grad(set_to_none=True)
            sys_.step()   # NOTE: warm-up: compiles, creates optimizer state, plans
            opt.zero_grad(set_to_none=True)
            sys_.step()
            sys_.prepare_s = time.perf_counter() - t0
        except Exception as e:  # NOTE: a failing peer is a result, recorded with its error
            sys_.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        systems.append(sys_)

    batch, loss_fn = case.batch, case.loss_fn
    add("eager", None, copy.deepcopy(case.model),
        lambda m, o: _eager_step(m, batch, loss_fn, o))
    eager = systems[0]
    add("checkpoint_blocks", None, checkpointed(case.model, case.block_types),
        lambda m, o: _eager_step(m, batch, loss_fn, o))
    peers = [s for s in systems if not s.error]
    _measure_memory(peers, batch)  # NOTE: first, so fitgraph can be asked for their peaks
    for b in budgets:
        add("fitgraph", b, copy.deepcopy(case.model),
            lambda m, o, b=b: _fitgraph_step(m, batch, loss_fn, o, b, time_budget, optimize,
                                             solver))
    plain = [s for s in systems if not s.error]
    compiled: list[_System] = []
    if compile:
        for b in budgets:
            # NOTE: each variant is compiled fresh (dynamo reset) and measured at once, timed
            # against eager in its own interleaved rounds, and never called again: after the
            # next reset it would silently recompile with the default budget
            torch._dynamo.reset()
            add("compile_aot_eager", b, copy.deepcopy(case.model),
                lambda m, o, b=b: _compiled_step(m, batch, loss_fn, o, b))
            variant = systems[-1]
            compiled.append(variant)
            if not variant.error:
                progress(f"  {case.name}: compile_aot_eager {b}: measuring")
                _measure_memory([variant], batch)
                _time_rounds([variant, eager], repeats)
                variant.ratio_to_eager = (statistics.median(variant.times)
                                          / statistics.median(eager.times))
        torch._dynamo.reset()
    if match_peers and eager.peak:
        for peer in [s for s in [*peers[1:], *compiled] if not s.error and s.peak]:
            add("fitgraph", peer.peak / eager.peak, copy.deepcopy(case.model),
                lambda m, o, b=int(peer.peak): _fitgraph_step(m, batch, loss_fn, o, b,
                                                             time_budget, optimize, solver),
                matched=peer.name if peer.budget is None else f"{peer.name} {peer.budget:g}")
            if not systems[-1].error:
                plain.append(systems[-1])
    progress(f"  {case.name}: {len(plain)} systems: memory, then {repeats} interleaved rounds")
    _measure_memory(plain, batch)
    _time_rounds(plain, repeats)
    eager_s = statistics.median(eager.times) if eager.times else None

    def step_s(s: _System) -> float | None:
        if not s.times:
            return None
        if s.ratio_to_eager is not None and eager_s is not None:
            return s.ratio_to_eager * eager_s  # NOTE: its ratio to eager, on the final eager time
        return statistics.median(s.times)

    return [BenchRow(case.name, s.name, s.budget, s.peak, step_s(s), s.prepare_s, s.error,
                     s.matched) for s in systems]


def verdicts(rows: list[BenchRow]) -> list[str]:
    """One line per peer row: fitgraph at that peer's measured peak — lower or equal peak and
    faster ("wins"), slower ("loses"), or not planned (its error)."""
    out = []
    for peer in rows:
        if peer.system in ("eager", "fitgraph") or peer.peak_bytes is None or not peer.step_s:
            continue
        label = peer.system if peer.budget is None else f"{peer.system} {peer.budget:g}"
        fg = next((r for r in rows if r.model == peer.model and r.matched == label), None)
        head = f"{peer.model}: at {label}'s peak {peer.peak_bytes / 2**20:.1f} MiB"
        if fg is None:
            continue
        if fg.error or fg.step_s is None or fg.peak_bytes is None:
            out.append(f"{head}: fitgraph did not plan ({fg.error or 'no time'})")
            continue
        word = ("wins" if fg.peak_bytes <= peer.peak_bytes and fg.step_s <= peer.step_s
                else "loses")
        out.append(f"{head}: fitgraph {fg.peak_bytes / 2**20:.1f} MiB, "
                   f"{fg.step_s * 1e3:.0f} ms vs {peer.step_s * 1e3:.0f} ms "
                   f"({fg.step_s / peer.step_s - 1:+.1%}): {word}")
    return out


def _measure_memory(systems: list[_System], batch) -> None:
    for s in systems:
        s.optimizer.zero_grad(set_to_none=True)
        before = resident_bytes(s.model, batch, s.optimizer)
        with MemoryMeter() as meter:
            s.step()
        s.peak = before + meter.peak_bytes


def _time_rounds(systems: list[_System], repeats: int) -> None:
    for s in systems:
        s.times = []
    for r in range(repeats):
        k = r % len(systems)
        for s in systems[k:] + systems[:k]:
            s.optimizer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            s.step()
            s.times.append(time.perf_counter() - t0)


def _compiled_step(model, batch, loss_fn, opt, budget: float):
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()  # NOTE: compile fresh: a cached graph would keep an earlier budget
    compiled = torch.compile(model, backend="aot_eager")
    first = [True]

    def step():
        if first[0]:  # NOTE: the budget is read when the first call compiles
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


def _fitgraph_step(model, batch, loss_fn, opt, budget: float, time_budget: float, optimize,
                   solver: str):
    # NOTE: one eager step first so AdamW state exists and the plan is the steady-state one
    _eager_step(model, batch, loss_fn, opt)()
    opt.zero_grad(set_to_none=True)
    step = optimize(model, batch, loss_fn, opt, budget=budget, time_budget=time_budget,
                    solver=solver)
    return lambda: step(batch)
