"""Who wins at each peer's peak: fitgraph's row planned for a peer's measured peak against
the peer's own row (``fitgraph bench``'s verdicts, the report's and ``glance``'s counts).

Example:
    >>> from fitgraph.bench.harness import BenchRow
    >>> from fitgraph.bench.verdicts import verdicts
    >>> peer = BenchRow("m", "rotor", 0.5, 100 * 2**20, 0.2)
    >>> ours = BenchRow("m", "fitgraph", 0.5, 90 * 2**20, 0.19, matched="rotor 0.5")
    >>> verdicts([peer, ours])
    ["m: at rotor 0.5's peak 100.0 MiB: fitgraph 90.0 MiB, 190 ms vs 200 ms (-5.0%): wins"]
"""

from __future__ import annotations

from .harness import FITGRAPHS, BenchRow

__all__ = ["fitgraph_at", "matched_labels", "outcome", "peer_label", "verdicts"]


def matched_labels(row: BenchRow) -> list[str]:
    return [s for s in row.matched.split(", ") if s]


def peer_label(peer: BenchRow) -> str:
    """How fitgraph's rows name a peer row in ``matched``: 'rotor 0.5', 'checkpoint'."""
    return peer.system if peer.budget is None else f"{peer.system} {peer.budget:g}"


def fitgraph_at(rows: list[BenchRow], peer: BenchRow) -> BenchRow | None:
    """fitgraph's row planned for ``peer``'s measured peak (None: none was planned); of
    several (``FITGRAPHS``), the fastest within the peer's peak, else the first."""
    label = peer_label(peer)
    mine = [r for r in rows if r.model == peer.model and r.system in FITGRAPHS
            and label in matched_labels(r)]
    fits = [r for r in mine if not r.error and r.step_s is not None and r.peak_bytes is not None
            and peer.peak_bytes is not None and r.peak_bytes <= peer.peak_bytes]
    return min(fits, key=lambda r: r.step_s) if fits else next(iter(mine), None)


def outcome(rows: list[BenchRow], peer: BenchRow) -> tuple[BenchRow | None, str | None]:
    """(fitgraph's row at ``peer``'s peak, "wins" / "loses" / "did not plan"); (None, None)
    where ``peer`` is not a measured peer or fitgraph was not asked for its peak."""
    if peer.system in ("eager", *FITGRAPHS) or peer.peak_bytes is None or not peer.step_s:
        return None, None
    fg = fitgraph_at(rows, peer)
    if fg is None:
        return None, None
    if fg.error or fg.step_s is None or fg.peak_bytes is None:
        return fg, "did not plan"
    won = fg.peak_bytes <= peer.peak_bytes and fg.step_s <= peer.step_s
    return fg, "wins" if won else "loses"


def verdicts(rows: list[BenchRow]) -> list[str]:
    """One line per peer row: fitgraph at that peer's measured peak — lower or equal peak and
    faster ("wins"), slower ("loses"), or not planned (its error)."""
    out = []
    for peer in rows:
        fg, word = outcome(rows, peer)
        if fg is None:
            continue
        head = f"{peer.model}: at {peer_label(peer)}'s peak {peer.peak_bytes / 2**20:.1f} MiB"
        if word == "did not plan":
            out.append(f"{head}: fitgraph did not plan ({fg.error or 'no time'})")
            continue
        out.append(f"{head}: fitgraph {fg.peak_bytes / 2**20:.1f} MiB, "
                   f"{fg.step_s * 1e3:.0f} ms vs {peer.step_s * 1e3:.0f} ms "
                   f"({fg.step_s / peer.step_s - 1:+.1%}): {word}")
    return out
