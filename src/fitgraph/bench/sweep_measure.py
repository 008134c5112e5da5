"""One sweep model, measured in this process: the row of ``python -m fitgraph.bench.sweep``.

Stages, in order (``row["stage"]`` names the one running, so a crash or a time-out in the
parent says where): build, eager (one AdamW step so its state exists, then the measured eager
peak and the lower bound), capture, plan (``optimize(latency_limit=1.10)``), compare (one
AdamW step of the plan against eager from the same weights, optimizer state and RNG), time
(the plan at 1.10 in rounds beside eager alone, each timed step right after an eager one,
``harness._time_rounds``; at least ``rounds``, more for a short step: ``timed_rounds``), ckpt
(Hugging Face's ``gradient_checkpointing_enable()``, or per-block ``torch.utils.checkpoint``
where the model has none), at-ckpt (fitgraph at checkpointing's measured peak, in bytes),
time-ckpt (those two in rounds beside eager), smallest (``budget="smallest"``: the least peak
fitgraph reaches, fission allowed, simulated; planned and run once against eager from the
weights the time stage started from: its measured peak and results; for a step by regions
each region at its least and the step's peak measured). A stage that fails ends the row with
its error; the checkpointing stages fail alone (their error goes to ``notes``), since the model
itself ran.
"""

from __future__ import annotations

import copy
import inspect
import statistics
import time
from collections.abc import Callable

import torch

from ..capture.calling import compute_loss
from .harness import _eager_step, _measure_memory, _System, _time_rounds, error_text

__all__ = ["LR", "PARAM_ATOL", "REL_TOL", "checkpoint_blocks", "compare", "measure_model"]

LR = 1e-4
LATENCY_LIMIT = 1.10
# NOTE: with fission (no ``exact``), a split op sums in another order: fp32 rounding moves a
# gradient by a few ulps times the square root of the terms summed, ~1e-6 relative for our
# sizes; 1e-4 leaves two orders of margin and still catches a wrong gradient (O(1) relative)
REL_TOL = 1e-4
# NOTE: an AdamW update is at most ~lr per element; a wrong gradient moves it by O(lr), rounding
# by ~REL_TOL * lr except where |grad| is near AdamW's eps, where the update itself is << lr
PARAM_ATOL = 0.1 * LR
SEED = 1234


def _opt(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def _copied(model: torch.nn.Module, opt: torch.optim.Optimizer):
    """(a deep copy of ``model``, an AdamW over it with a deep copy of ``opt``'s state).

    NOTE: not ``harness._copied``: ``Optimizer.load_state_dict`` keeps the very tensors of the
    state dict it is given when dtype and device match (AdamW's ``step``, ``exp_avg``,
    ``exp_avg_sq``), so copies made from one optimizer share their state and each step of one
    moves the others'."""
    m = copy.deepcopy(model)
    o = _opt(m)
    o.load_state_dict(copy.deepcopy(opt.state_dict()))
    return m, o


def _exact_kwargs() -> dict:
    """``exact=True`` where ``fitgraph.optimize`` takes it (no fission: bitwise results)."""
    from ..api import optimize

    return {"exact": True} if "exact" in inspect.signature(optimize).parameters else {}


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """The largest difference relative to ``b``'s largest element, or to ``floor`` where that
    is smaller."""
    scale = max(b.abs().max().item() if b.numel() else 0.0, floor)
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


# NOTE: a gradient that is zero in exact arithmetic (an attention key's bias: softmax ignores a
# shift) is rounding noise; summed in another order it differs entirely, by nothing that
# matters: a tensor's differences are measured against at least this share of the largest
# gradient of the model (so a difference below REL_TOL x NOISE_FLOOR = 1e-5 of it is noise; a
# small but real gradient wrong by as much as itself still fails)
NOISE_FLOOR = 0.1


def compare(loss_e, loss_f, eager: torch.nn.Module, planned: torch.nn.Module) -> tuple[str, str]:
    """("bitwise" | "allclose" | "MISMATCH", detail): the plan's loss, gradients and updated
    parameters against eager's. Gradients and the loss within ``REL_TOL`` of the largest
    element (a gradient's, at least ``NOISE_FLOOR`` of the model's largest gradient),
    parameters within ``PARAM_ATOL``.

    Example:
        >>> m = torch.nn.Linear(2, 2); l = torch.tensor(1.0)
        >>> compare(l, l.clone(), m, m)
        ('bitwise', '')
    """
    pairs = [("loss", loss_e.detach(), loss_f.detach())]
    pe, pf = dict(eager.named_parameters()), dict(planned.named_parameters())
    for n, p in pe.items():
        q = pf[n]
        if (p.grad is None) != (q.grad is None):
            return "MISMATCH", f"grad of {n}: eager {'None' if p.grad is None else 'set'}, plan " \
                               f"{'None' if q.grad is None else 'set'}"
        if p.grad is not None:
            pairs.append((f"grad {n}", p.grad, q.grad))
    params = [(f"param {n}", p.detach(), pf[n].detach()) for n, p in pe.items()]
    if all(torch.equal(a, b) for _, a, b in pairs + params):
        return "bitwise", ""
    floor = NOISE_FLOOR * max((b.abs().max().item() for n, _, b in pairs[1:] if b.numel()),
                              default=0.0)
    worst = max(pairs, key=lambda t: _rel(t[2], t[1], floor))
    rel = _rel(worst[2], worst[1], floor)
    # NOTE: AdamW moves a parameter by about lr x m/sqrt(v) whatever the gradient's size: where
    # the eager gradient is rounding noise (below REL_TOL x the floor) in the steady step, the
    # update's sign and size are noise too (a BatchNorm bias: 1.3 lr apart), so only the
    # elements with a real gradient are compared
    grads = {n: p.grad for n, p in pe.items()}

    def real(name: str, d: torch.Tensor) -> torch.Tensor:
        g = grads.get(name.removeprefix("param "))
        return d if g is None or g.shape != d.shape else d[g.abs() > REL_TOL * floor]

    def pmax(t) -> float:
        d = real(t[0], (t[2].double() - t[1].double()).abs())
        return d.max().item() if d.numel() else 0.0
    pworst = max(params, key=pmax)
    pdiff = pmax(pworst)
    detail = f"max rel {rel:.1e} ({worst[0]}), params max abs {pdiff:.1e} ({pworst[0]})"
    ok = rel <= REL_TOL and pdiff <= PARAM_ATOL
    return ("allclose" if ok else "MISMATCH"), detail


def checkpoint_blocks(model: torch.nn.Module, block_types: tuple[type, ...]) -> torch.nn.Module:
    """A copy of ``model`` whose outermost modules of ``block_types`` (the root excluded) run
    under non-reentrant ``torch.utils.checkpoint``. NOTE: their ``forward`` is replaced on the
    instance instead of wrapping the module (``harness.checkpointed``): the parent may read the
    block's attributes (``nn.TransformerEncoder`` reads ``layers[0].self_attn``), which a
    wrapper hides.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        >>> c = checkpoint_blocks(m, (torch.nn.Sequential,))
        >>> "forward" in vars(c[0]) and "forward" not in vars(c)
        True
    """
    import functools

    from torch.utils.checkpoint import checkpoint

    model = copy.deepcopy(model)
    done: list[str] = []
    for name, mod in model.named_modules():
        if not name or not isinstance(mod, block_types):
            continue
        if any(name.startswith(d + ".") for d in done):
            continue   # NOTE: inside a checkpointed block already
        mod.forward = functools.partial(checkpoint, mod.forward, use_reentrant=False)
        done.append(name)
    return model


def _ckpt_model(case, model, opt):
    """(kind, model, optimizer): checkpointing as the model's users would turn it on."""
    if case.hf_checkpointing:
        m, o = _copied(model, opt)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return "hf", m, o
    if case.block_types:
        m = checkpoint_blocks(model, case.block_types)
        o = _opt(m)
        # NOTE: the same parameter order (wrapping keeps it); a copy of the state (see _copied)
        o.load_state_dict(copy.deepcopy(opt.state_dict()))
        return "per-block", m, o
    return "", None, None


def _planned_system(label, model, opt, batch, loss_fn, **kw) -> tuple[_System, object]:
    from ..api import optimize

    t0 = time.perf_counter()
    step = optimize(model, batch, loss_fn, opt, **kw)
    s = _System(label, None, model, opt, lambda: step(batch))
    s.prepare_s = time.perf_counter() - t0
    # NOTE: a step planned by regions (graph breaks) solves inside torch.compile, at its calls
    s.solve_s = step.plan_for(batch).solution.solve_s if hasattr(step, "plan_for") else None
    return s, step


def _settle(step, batch, calls: int = 8) -> None:
    """Run a step by regions until its plan is final and measured: compiling settles at the
    second or third call, the sixth where it planned the regions again (boundary holds).
    Each call as a training loop makes it, its gradients zeroed first (set to None).

    NOTE: a step by regions accumulates into ``.grad`` as eager PyTorch does; called again
    without zeroing, its measured peak held the last step's gradients from the start as well
    as its own (wav2vec2's smallest: 24.8 MB measured where a training loop's step peaks at
    21.1, its 3.75 MB of gradients twice), where every other system of the sweep is measured
    with its gradients set to None first (``harness._measure_memory``)."""
    for _ in range(calls):
        if step.settled:
            return
        step.optimizer.zero_grad(set_to_none=True)   # NOTE: the sweep's steps hold an AdamW
        step(batch)


def _run_smallest(row: dict, model, opt, batch, loss_fn, time_budget: float,
                  regions: bool) -> None:
    """Plan at the smallest peak fitgraph reaches (``budget="smallest"``: every transformation,
    fission included, its plan kept from the search) and run one step against eager from the
    same weights, state and RNG: ``smallest_peak`` (simulated; for a step by regions, which
    has no whole-step simulation, measured), ``smallest_measured`` and ``smallest_result``."""
    from ..api import optimize

    m_s, o_s = _copied(model, opt)
    twin_m, twin_o = _copied(model, opt)
    for o in (o_s, twin_o):  # NOTE: one step of a training loop each, gradients zeroed first
        o.zero_grad(set_to_none=True)
    step = optimize(m_s, batch, loss_fn, o_s, budget="smallest", time_budget=time_budget)
    torch.manual_seed(SEED)
    loss_e = compute_loss(twin_m, batch, loss_fn)
    loss_e.backward()
    twin_o.step()
    torch.manual_seed(SEED)
    loss_s = step(batch)
    row["smallest_result"], detail = compare(loss_e, loss_s, twin_m, m_s)
    if regions:
        _settle(step, batch)
        row["smallest_peak"] = step.report().measured_peak_bytes
        row["notes"] += "smallest peak: each region at its least, measured; "
    else:
        row["smallest_peak"] = step.report().planned_peak_bytes
    row["smallest_measured"] = step.report().measured_peak_bytes
    if row["smallest_result"] == "MISMATCH":
        row["notes"] += f"the smallest plan's results differ: {detail}; "


def latency_tries(notes: dict) -> str:
    """The latency check's tries as ``simulated/measured±spread@peak`` (the one kept starred),
    so a measured miss can be read off the row: "1.100/1.212±0.45@35.8MB*; ...".

    Example:
        >>> latency_tries({"latency_check": {"plan": "try 2", "tries": [
        ...     {"simulated": 1.1, "measured": 1.21, "spread": 0.4, "peak_bytes": 35_800_000},
        ...     {"simulated": 1.0, "measured": 1.03, "spread": 0.3, "peak_bytes": 64_000_000}]}})
        '1.100/1.210±0.40@35.8MB; 1.000/1.030±0.30@64.0MB*'
    """
    check = notes.get("latency_check") or {}
    kept = check.get("plan", "")
    out = []
    for i, t in enumerate(check.get("tries", ())):
        # NOTE: a step by regions may keep its regions unplanned (its last try)
        unplanned = "planned_for" in t and t["planned_for"] is None
        star = "*" if kept == ("unplanned" if unplanned else f"try {i + 1}") else ""
        out.append(f"{t['simulated']:.3f}/{t['measured']:.3f}±{t['spread']:.2f}"
                   f"@{t['peak_bytes'] / 1e6:.1f}MB{star}")
    return "; ".join(out) or str(kept)


# NOTE: a model's rounds time at least this many seconds of steps, and at most MAX_ROUNDS:
# ConvNeXt's 25 ms step measured +12.2% and then +9.3% over eager in two runs of 7 rounds
# (0.2 s of its plan's steps each), either side of the 12% line
MIN_TIMED_S = 3.0
MAX_ROUNDS = 41


def timed_rounds(rounds: int, step_s: float, systems: int) -> int:
    """The rounds to time: at least ``rounds``, and enough that ``systems`` steps of
    ``step_s`` each, every one beside an eager step, take ``MIN_TIMED_S`` (at most
    ``MAX_ROUNDS``; odd, so the median is a measured round).

    Example:
        >>> timed_rounds(7, 1.0, 3), timed_rounds(7, 0.025, 3), timed_rounds(7, 1e-4, 3)
        (7, 21, 41)
    """
    want = int(MIN_TIMED_S / max(2 * systems * step_s, 1e-9)) + 1
    n = max(rounds, min(want, MAX_ROUNDS))
    return n if n % 2 or n == rounds else n + 1


def _timed(systems: list[_System], rounds: int) -> None:
    """Times ``systems[1:]`` against ``systems[0]`` (eager), each warmed up first, in
    ``timed_rounds`` rounds (``harness._time_rounds``)."""
    eager = systems[0]
    for s in systems[1:]:
        s.optimizer.zero_grad(set_to_none=True)
        s.step()   # NOTE: warm-up (the first fitgraph step ran under the meter)
    eager.optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    eager.step()
    _time_rounds(systems, timed_rounds(rounds, time.perf_counter() - t0, len(systems) - 1),
                 reference=eager)


def measure_model(name: str, rounds: int = 7, time_budget: float = 30.0,
                  save: Callable[[dict], None] = lambda row: None) -> dict:
    """Measure sweep model ``name``; ``save(row)`` is called as each stage starts (the parent
    keeps the last one when this process dies). Errors end the row; nothing is raised."""
    from ..capture.api import capture
    from ..capture.errors import CaptureError
    from ..execute.host_memory import keep_host_memory
    from ..regions import breaks_into_regions
    from .sweep_models import build

    torch.set_num_threads(1)
    keep_host_memory()   # NOTE: eager and every plan timed with warm host memory (harness)
    row: dict = {"model": name, "status": "", "stage": "", "error": "", "notes": "",
                 "stage_s": {}}
    clock = [time.perf_counter()]

    def stage(s: str) -> None:
        now = time.perf_counter()
        if row["stage"]:
            row["stage_s"][row["stage"]] = round(now - clock[0], 2)
        row["stage"], clock[0] = s, now
        save(row)

    try:
        stage("build")
        case = build(name)
        row["family"] = case.family
        row["params"] = sum(p.numel() for p in case.model.parameters())
        batch, loss_fn = case.batch, case.loss_fn
        stage("eager")
        m_e, o_e = case.model, _opt(case.model)
        eager = _System("eager", None, m_e, o_e, _eager_step(m_e, batch, loss_fn, o_e))
        eager.step()   # NOTE: AdamW state exists from here on: every plan is the steady-state one
        o_e.zero_grad(set_to_none=True)
        from ..measure import resident_bytes, trainable_grad_bytes

        row["lower_bound"] = resident_bytes(m_e, batch, o_e) + trainable_grad_bytes(m_e)
        _measure_memory([eager], batch)
        row["eager_peak"] = eager.peak
        stage("capture")
        t0 = time.perf_counter()
        regions = False
        try:
            graph = capture(m_e, batch, loss_fn, o_e)
            row["capture_s"], row["nodes"] = time.perf_counter() - t0, len(graph.nodes)
            del graph
        except CaptureError as e:
            if not breaks_into_regions(e):
                raise
            # NOTE: optimize plans such a step by regions (torch.compile's graph breaks)
            regions = True
            row["notes"] += f"planned by regions ({error_text(e).splitlines()[0][:120]}); "
        stage("plan")
        exact = _exact_kwargs()
        row["exact"] = bool(exact)
        m_f, o_f = _copied(m_e, o_e)
        twin_m, twin_o = _copied(m_e, o_e)
        fg, step = _planned_system("fitgraph 1.10", m_f, o_f, batch, loss_fn,
                                   latency_limit=LATENCY_LIMIT, time_budget=time_budget, **exact)
        row["plan_s"], row["solve_s"] = fg.prepare_s, fg.solve_s
        row["winner"] = ("regions" if regions else
                         step.plan_for(batch).solution.notes.get("winner", ""))
        if not regions:
            row["latency_check"] = latency_tries(step.plan_for(batch).solution.notes)
        stage("compare")
        torch.manual_seed(SEED)
        loss_e = compute_loss(twin_m, batch, loss_fn)
        loss_e.backward()
        twin_o.step()
        torch.manual_seed(SEED)
        loss_f = step(batch)   # NOTE: a plan's first step is also its measured one
        row["result"], row["result_detail"] = compare(loss_e, loss_f, twin_m, m_f)
        row["peak_110"] = step.report().measured_peak_bytes
        if regions:   # NOTE: a step by regions checks its latency at its first call
            row["latency_check"] = latency_tries(step.report().notes)
        del twin_m, twin_o
        if row["result"] == "MISMATCH":
            row["status"], row["error"] = "MISMATCH", row["result_detail"]
            return row
        # NOTE: the weights the smallest plan starts from, before a timed step moves them
        m_w, o_w = _copied(m_e, o_e)
        # NOTE: the plan at 1.10 is timed beside eager alone, as a training loop runs it:
        # with a checkpointed model's steps in the same rounds, ConvNeXt's plan measured
        # 1.09-1.16x eager, beside eager alone 1.04-1.06x (its latency check: 1.08x); and
        # before the smallest plan's search, whose leftovers slowed every later step
        stage("time")
        if regions:   # NOTE: compiling (and planning again) belongs to no timed round
            _settle(step, batch)
        _timed([eager, fg], rounds)
        row["eager_step_s"] = statistics.median(eager.times)
        if regions:  # NOTE: a step by regions is measured once compiling settled
            row["peak_110"] = step.report().measured_peak_bytes
        row["overhead_110"] = statistics.median(fg.ratios) - 1
        systems = [eager]
        ckpt = at_ckpt = None
        stage("ckpt")
        try:
            kind, m_c, o_c = _ckpt_model(case, m_e, o_e)
            row["ckpt_kind"] = kind
            if kind:
                ckpt = _System(f"ckpt {kind}", None, m_c, o_c,
                               _eager_step(m_c, batch, loss_fn, o_c))
                ckpt.step()
                _measure_memory([ckpt], batch)
                row["ckpt_peak"] = ckpt.peak
                systems.append(ckpt)
        except Exception as e:  # NOTE: the baseline failing is a note; fitgraph's rows stand
            row["notes"] += f"checkpointing: {error_text(e)}; "
            ckpt = None
        if ckpt is not None:
            stage("at-ckpt")
            m_g, o_g = _copied(m_e, o_e)
            try:
                at_ckpt, step_c = _planned_system("fitgraph @ckpt", m_g, o_g, batch, loss_fn,
                                                  budget=int(ckpt.peak),
                                                  time_budget=time_budget, **exact)
                o_g.zero_grad(set_to_none=True)
                step_c(batch)
                row["peak_at_ckpt"] = step_c.report().measured_peak_bytes
                systems.append(at_ckpt)
            except Exception as e:
                row["notes"] += f"at checkpointing's peak: {error_text(e)}; "
        if ckpt is not None:
            stage("time-ckpt")
            if regions and at_ckpt is not None:
                _settle(step_c, batch)
                row["peak_at_ckpt"] = step_c.report().measured_peak_bytes
            _timed(systems, rounds)
            row["ckpt_overhead"] = statistics.median(ckpt.ratios) - 1
            if at_ckpt is not None:
                row["at_ckpt_overhead"] = statistics.median(at_ckpt.ratios) - 1
                # NOTE: both were timed against the same eager steps in each round
                row["at_ckpt_vs_ckpt"] = statistics.median(
                    f / c for f, c in zip(at_ckpt.ratios, ckpt.ratios))
        stage("smallest")
        t0 = time.perf_counter()
        try:
            _run_smallest(row, m_w, o_w, batch, loss_fn, time_budget, regions)
        except Exception as e:
            row["notes"] += f"the smallest plan did not run: {error_text(e)}; "
        row["smallest_s"] = time.perf_counter() - t0
        row["status"] = "ok"
    except Exception as e:  # NOTE: every failure is the row's result, never a crash of the sweep
        row["status"] = f"{row['stage']} error"
        row["error"] = error_text(e)
        row["error_type"] = type(e).__name__
    finally:
        row["stage_s"][row["stage"]] = round(time.perf_counter() - clock[0], 2)
        row["notes"] = row["notes"].strip("; ")
        save(row)
    return row
