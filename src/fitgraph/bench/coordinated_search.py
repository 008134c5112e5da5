"""The coordinated search (``solver="search"``) against ``auto``, measured (issue 30).

    python -m fitgraph.bench.coordinated_search [--models gpt2,bert-base,...]
        [--budgets 0.8,0.6,0.4] [--limits 1.05,1.10] [--time-budget 30] [--repeats 16]
        [--out docs/bench/coordinated_search.json] [--resume]
    python -m fitgraph.bench.coordinated_search --rules [--out docs/bench/rules.json]

For each zoo model (small configuration, AdamW in the step, torch on one thread, this
machine's measured op costs) and each constraint — a budget (a fraction of the eager plan's
simulated peak; least time) or a latency limit (a factor of the eager step; least peak) —
``fitgraph.optimize`` plans with ``auto`` (``--time-budget`` seconds, optimize's default 30)
and with ``search`` (three times as long: its first candidate is auto's plan with a third of
it, every later one at most ``solvers.coordinated.CANDIDATE_S``), both on one
measured cost model (so that the search's first candidate is auto's very plan), without
optimize's latency check (which times a plan and plans again for a tighter limit: it acts on
any solver's plan, so the rows compare the solvers' own). Both plans and
eager run in one process: the peak once under the allocator meter (resident bytes included),
the step time in interleaved rounds, each plan's step between two eager steps
(``harness._time_rounds``). A row gives both plans' measured peak and step time (as fractions
of eager's: the median over rounds of each one's step over the eager steps around it), the
search's step over auto's (paired: the median over rounds of the two steps' ratio, with the
90% bootstrap interval of that median, ``paired_interval``; the gain in budget mode), the
rules of the search's plan and what they changed
(``notes["candidates"]``), and its winner (with the search's own timing of the candidate it
chose, against auto's step in budget mode, the eager plan's in latency mode:
``notes["confirmed"]``); where the search returns
auto's very plan (same graph, same instructions) the gain is 0 by definition, whatever the
rounds measured. With
``--rules``: each rule alone on each captured step, its eager plan simulated (``rule_rows``).
Plans follow the cost cache's numbers: where its entries were measured in different states of
the machine (a split graph's parts under load, the captured ops quiet), a plan simulates far
from what it measures; ``FITGRAPH_CACHE_DIR=<an empty folder>`` measures every op in the run.

Example:
    >>> row = {"kind": "budget", "auto_step": 1.10, "search_step": 1.05, "auto_peak": 0.6,
    ...        "search_peak": 0.6, "rules": ["inverse_pairs"], "winner": "fission"}
    >>> round(gain(row), 4), gain(dict(row, rules=[])), round(raw_gain(dict(row, rules=[])), 4)
    (0.0455, 0.0, 0.0455)
    >>> round(gain(dict(row, paired_search_over_auto=0.96)), 4)
    0.04
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import statistics
import time
from pathlib import Path

__all__ = ["as_fast_in_less", "gain", "losses", "main", "markdown", "no_slower_over",
           "over_limit", "own_gain", "paired_interval", "peak_gain", "raw_gain", "replanned",
           "rule_effects", "rule_markdown", "rule_rows", "run_model", "undecided", "wins"]

MODELS = ("gpt2", "bert-base", "llama", "vit-b16", "resnet50", "unet")
SEARCH_FACTOR = 3.0


def gain(row: dict) -> float | None:
    """What the search's plan gains over auto's, measured: the step time in budget mode, the
    peak in latency mode (a fraction: 0.05 = 5% less); 0 where it is auto's very plan, or
    auto's plan made again inside the search (``replanned``); None where either found no plan
    within the budget."""
    if row.get("same_plan") or replanned(row):
        return 0.0
    return raw_gain(row)


def raw_gain(row: dict) -> float | None:
    """``gain`` as measured, whoever made the search's plan: in budget mode from the two plans'
    steps paired round by round (``paired_search_over_auto``), where the row has them."""
    if "search_peak" not in row or "auto_peak" not in row:
        return None
    if row["kind"] == "budget" and "paired_search_over_auto" in row:
        # NOTE: not each one's median over the eager steps around it: an eager step's page
        # faults (a fresh mapping for each block over 32 MiB: GPT-2 small's logits, 24,579 a
        # step) come and go with what ran before it, so the brackets move each plan's ratio
        # by their own noise (GPT-2 at 0.8, one plan in two systems: 0.962 and 1.012 of eager,
        # 1.003 of each other, paired)
        return 1 - row["paired_search_over_auto"]
    what = "step" if row["kind"] == "budget" else "peak"
    return 1 - row[f"search_{what}"] / row[f"auto_{what}"]


# NOTE: one plan in two systems, 16 paired rounds, measured 0.98-1.02x itself from process to
# process (session 71: U-Net at 0.6, the two systems on copies of the model or on one): a
# row's ratio is shown with how far its rounds' median moves when they are drawn again
INTERVAL = 0.9
DRAWS = 2000


def paired_interval(ratios: list[float], level: float = INTERVAL, draws: int = DRAWS,
                    seed: int = 0) -> list[float]:
    """The ``level`` bootstrap interval of the median of ``ratios`` (each round's step of the
    search's plan over auto's): the rounds drawn again with replacement ``draws`` times (a
    fixed seed), the medians' ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles, rounded
    to 4 places.

    Example:
        >>> paired_interval([0.97, 0.98, 0.99, 1.0, 1.01] * 3)   # 15 rounds
        [0.98, 1.0]
        >>> paired_interval([1.0] * 4)
        [1.0, 1.0]
    """
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(draws))
    lo = medians[int((1 - level) / 2 * draws)]
    hi = medians[min(draws - 1, int((1 + level) / 2 * draws))]
    return [round(lo, 4), round(hi, 4)]


# NOTE: the paired ratios the count turns on (a win in time under 0.97, a loss over 1.01): a
# row whose interval holds one is timed again, ``repeats`` more rounds at a time, up to
# MORE_ROUNDS times ``repeats`` in all (ViT-B/16 small at 0.4, session 72: 16 rounds' median
# 1.019, its interval 0.966..1.061), wins and losses alike
DECIDES = (0.97, 1.01)
MORE_ROUNDS = 3


def undecided(ratios: list[float]) -> bool:
    """Whether the paired interval of ``ratios`` holds one of ``DECIDES``.

    Example:
        >>> undecided([0.96, 0.98, 1.0] * 5), undecided([0.94, 0.95, 0.96] * 5)
        (True, False)
    """
    lo, hi = paired_interval(ratios)
    return any(lo < t < hi for t in DECIDES)


def _timed_until_decided(eager, pair: dict, repeats: int, same: bool, time_rounds) -> None:
    """``time_rounds`` (``harness._time_rounds``) over eager and ``pair``'s systems, ``repeats``
    rounds, and again where both solvers planned, their plans differ (``same``) and the
    rounds' paired ratios are ``undecided`` — each system's rounds kept, up to
    ``MORE_ROUNDS`` times."""
    systems = [eager, *pair.values()]
    kept: dict[int, dict] = {}
    for _ in range(MORE_ROUNDS):
        time_rounds(systems, repeats, reference=eager)
        for s in systems:
            for attr, before in kept.get(id(s), {}).items():
                setattr(s, attr, before + getattr(s, attr))
        if len(pair) < 2 or same or not undecided(
                [a / b for a, b in zip(pair["search"].times, pair["auto"].times)]):
            return
        kept = {id(s): {a: list(getattr(s, a)) for a in ("times", "ratios", "faults")
                        if getattr(s, a) is not None} for s in systems}


def _interval(row: dict, gain_of: bool) -> str:
    """A row's paired interval in its cell's terms (a gain: 1 - ratio; else the ratio), or ""
    where the row has none (runs before session 71)."""
    lo, hi = row.get("paired_interval") or (None, None)
    if lo is None:
        return ""
    if gain_of:
        return f" [{INTERVAL:.0%}: {100 * (1 - hi):+.1f}..{100 * (1 - lo):+.1f}%]"
    return f" [{INTERVAL:.0%}: {lo:.3f}..{hi:.3f}]"


def replanned(row: dict) -> bool:
    """Whether the search returned its first candidate's plan — ``auto`` on the captured
    graph, run inside the search — that differs from the row's own ``auto`` run: no rule, not
    the exact scheduler's order. Planning on measured costs is not repeatable to the plan
    (fission's and hotspot's searches stop at a deadline; split graphs are profiled as they
    are picked), so such a row measures auto against itself, not the search."""
    # NOTE: no winner: not the search's plan at all (optimize's latency check fell back to
    # eager PyTorch, ``--latency-check``): measured as it is, a loss where it is one
    return (not row.get("same_plan") and "search_peak" in row and not row.get("rules")
            and row.get("winner") is not None and "exact order" not in str(row.get("winner")))


def rule_effects(row: dict) -> str:
    """Each rule alone on the captured graph, simulated against auto's plan there: "rule
    -1.2%" (time in budget mode, peak in latency mode; negative: better), "rule ✗" where its
    candidate found no plan within the constraint; "not recorded" for a row without the
    search's candidates."""
    cands = row.get("candidates") or []
    if not cands:
        return "not recorded"
    what = "latency_s" if row["kind"] == "budget" else "peak_bytes"
    base = cands[0].get(what) if cands else None
    out = []
    for c in cands[1:]:
        if len(c["rules"]) != 1:
            continue
        if base is None or "failed" in c:
            out.append(f"{c['rules'][0]} ✗")
        else:
            out.append(f"{c['rules'][0]} {100 * (c[what] / base - 1):+.1f}%")
    return "; ".join(out) or "no rule matched"


def _planned(model, batch, loss_fn, opt, constraint: tuple[str, float], solver: str,
             time_budget: float, cost_model, latency_check: bool = False):
    from ..api import optimize
    from .harness import _fitgraph_step

    kind, value = constraint
    # NOTE: by default the solvers' own plans: optimize's latency check (time the plan, plan
    # again for a tighter limit where it runs over) acts on any solver's plan after it, and on
    # this shared machine it re-planned one of two equal plans on noise (GPT-2 at 1.05: 0.589
    # vs 0.659); ``latency_check`` runs it, so that each plan holds its limit measured
    return _fitgraph_step(model, batch, loss_fn, opt, value if kind == "budget" else None,
                          time_budget, optimize, solver, cost_model=cost_model,
                          measure_latency=latency_check,
                          latency_limit=value if kind == "latency" else None)


def run_model(name: str, constraints: list[tuple[str, float]], time_budget: float,
              repeats: int, progress=print, skip: frozenset = frozenset(),
              latency_check: bool = False) -> list[dict]:
    """One row per constraint (module doc), but those in ``skip`` ((model, kind, value));
    ``latency_check``: optimize's latency check on both solvers' plans (``_planned``)."""
    import torch

    from .. import zoo
    from ..cost.profiler import ProfiledCostModel
    from ..solvers.base import BudgetInfeasible
    from .harness import _eager_step, _measure_memory, _System, _time_rounds

    case = zoo.build(name, "small")
    batch, loss_fn = case.batch, case.loss_fn
    # NOTE: one cost model for both solvers: the search's first candidate is then auto's very
    # plan (each optimize() measuring ops in its step anew would plan on other numbers)
    cost_model = ProfiledCostModel(progress=False)

    def system(label, make):
        model = copy.deepcopy(case.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        s = _System(label, None, model, opt, lambda: None)
        t0 = time.perf_counter()
        s.step = make(model, opt)
        s.prepare_s = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
        s.step()
        return s

    eager = system("eager", lambda m, o: _eager_step(m, batch, loss_fn, o))
    _measure_memory([eager], batch)
    rows = []
    for c in constraints:
        if (name, *c) in skip:
            continue
        pair, least = {}, {}
        for solver, budget_s in (("auto", time_budget), ("search", SEARCH_FACTOR * time_budget)):
            try:
                pair[solver] = system(solver, lambda m, o, solver=solver, budget_s=budget_s, c=c:
                                      _planned(m, batch, loss_fn, o, c, solver, budget_s,
                                               cost_model, latency_check))
            except BudgetInfeasible as e:
                least[solver] = e.smallest_peak_bytes
                progress(f"  {name} {c[0]} {c[1]:g}: {solver}: {e}")
                continue
            progress(f"  {name} {c[0]} {c[1]:g}: {solver} planned in "
                     f"{pair[solver].prepare_s:.1f} s")
        row = {"model": name, "kind": c[0], "value": c[1], "eager_peak": eager.peak}
        for k, nbytes in least.items():
            row[f"{k}_infeasible"] = nbytes / eager.peak   # NOTE: of the measured eager peak
        sols = {k: s.step.solution for k, s in pair.items()}
        # NOTE: the same plan on the same graph: any measured difference is the machine's
        same = len(pair) == 2 and (sols["search"].plan.instructions
                                   == sols["auto"].plan.instructions
                                   and not sols["search"].notes.get("rules"))
        if pair:
            _measure_memory(list(pair.values()), batch)
            _timed_until_decided(eager, pair, repeats, same, _time_rounds)
            row["eager_step_s"] = statistics.median(eager.times)
            # NOTE: minor page faults a step: where a step's large blocks come fresh from the
            # kernel moves its time (GPT-2 at 0.8: one plan in two systems measured 6% apart)
            row["eager_faults"] = statistics.median(eager.faults) if eager.faults else None
        for k, s in pair.items():
            row[f"{k}_peak"] = s.peak / eager.peak
            row[f"{k}_step"] = statistics.median(s.ratios)
            row[f"{k}_sim_peak"] = sols[k].sim.peak_bytes
            row[f"{k}_sim_latency_s"] = sols[k].sim.latency_s
            row[f"{k}_solve_s"] = sols[k].solve_s
            row[f"{k}_faults"] = statistics.median(s.faults) if s.faults else None
        if len(pair) == 2:
            rounds = [a / b for a, b in zip(pair["search"].times, pair["auto"].times)]
            row["paired_search_over_auto"] = statistics.median(rounds)
            row["paired_rounds"] = [round(x, 4) for x in rounds]
            row["paired_interval"] = paired_interval(rounds)
            row["same_plan"] = same
        for k, sol in sols.items():
            if "latency_check" in sol.notes:
                row[f"{k}_latency_check"] = sol.notes["latency_check"]
        if "search" in sols:
            notes = sols["search"].notes
            row.update(rules=notes.get("rules", []), winner=notes.get("winner"),
                       candidates=notes.get("candidates", []), confirmed=notes.get("confirmed"))
        row["gain"] = gain(row)
        rows.append(row)
        progress(json.dumps(row))
    return rows


def _cell(row: dict, solver: str) -> str:
    if f"{solver}_peak" in row:
        over = " (over the limit)" if over_limit(row, solver) else ""
        return f"{row[f'{solver}_peak']:.3f} / {row[f'{solver}_step']:.3f}{over}"
    return f"no plan (least peak {row[f'{solver}_infeasible']:.3f})"


def _outcome(row: dict) -> str:
    if "search_peak" in row:
        return "fits where auto does not"
    return "neither fits" if "auto_peak" not in row else "auto fits, the search does not"


def own_gain(row: dict) -> float | None:
    """What the search's plan gains over its own first candidate (auto inside the search): the
    step time in budget mode — as the search measured it against that candidate's where it
    timed the two (``notes["confirmed"]``), else simulated — the peak in latency mode; None
    where either has no plan (or the row no candidates). The search's doing, apart from auto's
    run-to-run spread."""
    timed = row.get("confirmed")
    if row["kind"] == "budget" and timed and timed["kept"] == "search":
        return 1 - timed["measured_over_auto"]
    cands = row.get("candidates") or []
    what, sim = (("latency_s", "latency_s") if row["kind"] == "budget"
                 else ("peak_bytes", "peak"))   # NOTE: a candidate's key, the row's
    first = cands[0].get(what) if cands else None
    mine = row.get(f"search_sim_{sim}")
    if not first or mine is None:
        return None
    return 1 - mine / first


def peak_gain(row: dict) -> float | None:
    """A budget row's second gain: the search's measured peak under auto's (a fraction), where
    its plan is not auto's (``same_plan``, ``replanned``: 0); None where either has no plan."""
    if "search_peak" not in row or "auto_peak" not in row:
        return None
    if row.get("same_plan") or replanned(row):
        return 0.0
    return 1 - row["search_peak"] / row["auto_peak"]


def as_fast_in_less(row: dict) -> bool:
    """A budget row where the search's plan measured at least 3% lower in peak than auto's and
    than its own first candidate's (simulated), its step no worse (not 1% slower, paired):
    the same step in less memory (``search_timing.HEADROOM``)."""
    cands = row.get("candidates") or []
    first = cands[0].get("peak_bytes") if cands else None
    return (row["kind"] == "budget" and row.get("gain") is not None and row["gain"] >= -0.01
            and (peak_gain(row) or 0.0) >= 0.03 and bool(first)
            and 1 - row["search_sim_peak"] / first >= 0.03)


def over_limit(row: dict, solver: str) -> bool:
    """Whether ``solver``'s plan of a latency row measured over the limit (its step over
    eager's, as the bench timed them)."""
    return row["kind"] == "latency" and row.get(f"{solver}_step", 0.0) > row["value"]


def no_slower_over(row: dict) -> bool:
    """A latency row where both plans measured over the limit and the search's step no slower
    than auto's (paired, not 1% slower): a lower peak there was not bought with time
    (``search_timing.NO_SLOWER``)."""
    return (over_limit(row, "search") and over_limit(row, "auto")
            and row.get("paired_search_over_auto", float("inf")) <= 1.01)


def wins(rows: list[dict]) -> int:
    """Cases where the search gains at least 3% measured over auto's plan and over its own
    first candidate (``own_gain``: so not by auto's run-to-run spread alone), or fits where
    auto does not, or (budget mode) runs as fast in 3% less memory (``as_fast_in_less``); in
    latency mode only with its plan measured within the limit, or over it where auto's is too
    and no slower than auto's (``no_slower_over``: a lower peak bought with time over the
    limit is no win)."""
    return sum((not over_limit(r, "search") or no_slower_over(r)) and (
        r["gain"] >= 0.03 and (own_gain(r) or 0.0) >= 0.03 or as_fast_in_less(r)
        if r["gain"] is not None else "search_peak" in r and "auto_peak" not in r)
        for r in rows)


def losses(rows: list[dict]) -> int:
    """Cases where the search's plan measured more than 1% worse than auto's, or (latency
    mode) over the limit where auto's measured within it, or over it more than 1% slower than
    auto's plan over it too; not where the search's plan held the
    limit that auto's measured over (its lower peak was bought with time over the limit), nor
    where it is auto's plan (``same_plan``, ``replanned``: the rounds' difference is the
    machine's)."""
    return sum(map(_lost, rows))


def _lost(row: dict) -> bool:
    if row.get("same_plan") or replanned(row):
        return False
    search_over, auto_over = over_limit(row, "search"), over_limit(row, "auto")
    if search_over and "auto_step" in row and not auto_over:
        return True
    if auto_over and not search_over:
        return False   # NOTE: the search held the limit auto's plan missed
    if search_over and auto_over and not no_slower_over(row):
        return True   # NOTE: both over the limit, the search's plan slower there
    return row["gain"] is not None and row["gain"] < -0.01


def markdown(rows: list[dict]) -> str:
    lines = ["| model | constraint | auto: peak / step | search: peak / step | search's gain | "
             "over its first candidate (timed, else simulated) | rules in the search's plan | "
             "its winner | each rule alone (simulated) |",
             "|---|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        what = (f"budget {r['value']:g}" if r["kind"] == "budget" else f"latency ≤ {r['value']:g}×")
        unit = "time" if r["kind"] == "budget" else "peak"
        # NOTE: the same plan in two systems, paired: the bench's own spread, shown
        same = (f"auto's plan (measured {r['paired_search_over_auto']:.3f}× itself"
                f"{_interval(r, False)})" if "paired_search_over_auto" in r else "auto's plan")
        paired = _interval(r, True) if r["kind"] == "budget" else ""
        won = (same if r.get("same_plan") else _outcome(r) if r["gain"] is None
               else f"auto's plan made again ({100 * raw_gain(r):+.1f}% {unit}{paired})"
               if replanned(r) else f"{100 * r['gain']:+.1f}% {unit}{paired}"
               + (f", {100 * peak_gain(r):+.1f}% peak" if as_fast_in_less(r) else ""))
        own = own_gain(r)
        lines.append(f"| {r['model']} | {what} | {_cell(r, 'auto')} | {_cell(r, 'search')} | "
                     f"{won} | {'—' if own is None else f'{100 * own:+.1f}%'} | "
                     f"{', '.join(r.get('rules', [])) or '—'} | "
                     f"{_winner(r)} | {rule_effects(r)} |")
    return "\n".join(lines)


def _winner(row: dict) -> str:
    """What made the search's plan, and where the search timed a candidate's plan inside
    (``notes["confirmed"]``: against auto's in budget mode, the eager plan's in latency mode),
    that ratio and which plan it kept."""
    out = row.get("winner") or "—"
    c = row.get("confirmed")
    if c:
        kept = "" if c["kept"] == "search" else f"; {' + '.join(c['rules']) or 'its order'} dropped"
        over = "auto" if "measured_over_auto" in c else "eager"
        if over == "auto" and c["kept"] == "search" and c.get("for") == "peak":
            kept = "; as fast in less memory"   # NOTE: search_timing.HEADROOM's
        from ..solvers.search_timing import NO_SLOWER
        if NO_SLOWER in c:
            kept = f"; {c[NO_SLOWER]:.3f}× auto's step, both over the limit"
        out += f" (timed {c[f'measured_over_{over}']:.3f}× {over}'s{kept})"
    return out


def rule_rows(models: list[str]) -> list[dict]:
    """Each rule alone on each model's captured step (small configuration, no optimizer):
    its matches, the bytes they no longer make (the rule's own count), and the eager plan of
    the rewrite against the captured one's, simulated on the roofline of cpu-generic."""
    from .. import capture, zoo
    from ..cost import RooflineCostModel, get_device
    from ..plan.eager import eager_plan
    from ..sim.simulate import simulate
    from ..transform.rules import RULES

    cost = RooflineCostModel(get_device("cpu-generic"))
    rows = []
    for name in models:
        case = zoo.build(name, "small")
        g = capture(case.model, case.batch, case.loss_fn)
        base = simulate(g, eager_plan(g), cost)
        for rule in RULES.values():
            matches = rule.find(g)
            row = {"model": name, "rule": rule.name, "matches": len(matches),
                   "bytes_saved": sum(m.bytes_saved for m in matches)}
            if matches:
                g2 = rule.rewrite(g)
                sim = simulate(g2, eager_plan(g2), cost)
                row.update(nodes=len(g2.nodes) - len(g.nodes),
                           peak=sim.peak_bytes / base.peak_bytes,
                           latency=sim.latency_s / base.latency_s)
            rows.append(row)
    return rows


def rule_markdown(rows: list[dict]) -> str:
    lines = ["| model | rule | matches | bytes no longer made | nodes | eager peak | eager step |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r["matches"]:
            continue
        lines.append(f"| {r['model']} | {r['rule']} | {r['matches']} | "
                     f"{r['bytes_saved'] / 2**20:+.2f} MiB | {r['nodes']:+d} | {r['peak']:.4f} | "
                     f"{r['latency']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fitgraph.bench.coordinated_search",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--budgets", default="0.8,0.6,0.4")
    p.add_argument("--limits", default="1.05,1.10")
    p.add_argument("--time-budget", type=float, default=30.0)
    # NOTE: 16, not 7: the same plan in two systems measured 0.897-1.055x itself in 7 paired
    # rounds (session 70's budget rows; single rounds 0.77-1.26x on U-Net); a row's rounds take
    # seconds, its planning minutes. Even: the two plans' order alternates by round
    # (``harness._time_rounds``), and the one run second measured ~1% slower
    p.add_argument("--repeats", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--resume", action="store_true",
                   help="keep the rows already in --out and run only the missing cases")
    p.add_argument("--latency-check", action="store_true",
                   help="latency rows: optimize's latency check on both plans (each timed "
                        "against eager's step and planned again where it runs over the limit)")
    p.add_argument("--rules", action="store_true",
                   help="each rule alone on each model (simulated, roofline): nothing planned")
    args = p.parse_args(argv)
    if args.rules:
        rows = rule_rows(args.models.split(","))
        print(rule_markdown(rows))
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
        return 0
    import torch

    from ..execute.host_memory import keep_host_memory

    # NOTE: from the start: the first model's ops were profiled with glibc's adaptive
    # thresholds (fresh pages for some tensors) and timed, later, with memory kept
    keep_host_memory()
    torch.set_num_threads(1)
    constraints = ([("budget", float(b)) for b in args.budgets.split(",") if b]
                   + [("latency", float(x)) for x in args.limits.split(",") if x])
    rows = []
    if args.resume and args.out and Path(args.out).exists():
        rows = json.loads(Path(args.out).read_text())["rows"]
        for r in rows:
            r["gain"] = gain(r)   # NOTE: as this version counts
    for name in args.models.split(","):
        done = frozenset((r["model"], r["kind"], r["value"]) for r in rows)
        rows += run_model(name, constraints, args.time_budget, args.repeats, skip=done,
                          latency_check=args.latency_check)
        summary = write(args, rows, torch.__version__)   # NOTE: after each model: resumable
    print(markdown(rows))
    print(summary)
    return 0


def write(args, rows: list[dict], torch_version: str) -> str:
    """The summary line; the rows and it written to ``args.out`` (where given)."""
    again = sum(map(replanned, rows))
    summary = (f"{len(rows)} cases: the search gains ≥ 3% (measured over auto, and over its own "
               f"first candidate as the search timed it or simulated it; or fits where auto "
               f"does not; or, within a budget, as fast in ≥ 3% less memory; latency rows: its "
               f"plan measured within the limit, or over it no slower than auto's over it) on "
               f"{wins(rows)}, loses on {losses(rows)} (more than 1% measured, or over the "
               f"limit auto's plan held, or slower over it); returns "
               f"auto's plan made again on {again}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "machine": platform.processor() or platform.machine(), "torch": torch_version,
            "threads": 1, "time_budget_s": args.time_budget, "repeats": args.repeats,
            "latency_check": args.latency_check,
            "summary": summary, "rows": rows}, indent=1))
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
