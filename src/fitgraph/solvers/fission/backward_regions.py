"""The regions ``split_backward`` tries at a remat plan's peak, and how each is made.

A candidate is a forward region re-made in the backward and run there in parts with the
backward ops that read it (``COPIES``: in every block alike), or a plain split of a region the
peak holds (``PLAIN``). Each comes with a recipe, ``recipe(graph, parts, deadline)``, that
finds its start by name: the same split can be made again on another graph (the search's path
replayed in more parts) and in any number of parts.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.graph.ir import Phase
    >>> from fitgraph.solvers.fission.backward_regions import copies_recipe
    >>> mlp = lambda: torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
    ...                                   torch.nn.Linear(64, 16))
    >>> model = torch.nn.Sequential(mlp(), mlp())
    >>> g = fitgraph.capture(model, torch.randn(64, 16), lambda m, x: m(x).square().mean())
    >>> gelu = next(n for n in g.nodes if "gelu" in n.target and n.phase is Phase.FORWARD)
    >>> split = copies_recipe(g.values[gelu.outputs[0]].name, 0, 0.0)(g, 4, float("inf"))
    >>> sum(n.name.endswith(".part3") for n in split.nodes) > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable

from ...cost.clock import planning_now
from ...graph.analysis import GraphError, new_storages, storage_producer
from ...graph.dim_region import Region, grow_region
from ...graph.dim_rules import SHAPE_ONLY
from ...graph.ir import Graph, Phase
from ...sim.simulate import SimResult
from ...transform.fission import FissionError, split_region
from ...transform.fission_halo_grads import separate_input_grads
from ...transform.products_into_sums import products_into_sums
from ...transform.recompute_copies import COPY_SUFFIX, CopyError, copy_set
from ...transform.sums_in_place import sums_in_place
from ..base import Solution
from .copies_regions import copies_region, late_copies
from .forward_regions import forward_nodes, linked_nodes
from .peak_regions import peak_starts, shared_regions, trimmed

__all__ = ["COPIES", "PARTS", "PLAIN", "Recipe", "alike_split_recipe", "candidates",
           "copies_recipe", "plain_recipe", "products_folded"]

# NOTE: parts per split in the search's rounds: a block's attention an eighth at a time; the path
# found is made again in more (``fission_backward.REPLAY_PARTS``)
PARTS = 8
MAX_STORAGES = 3
# NOTE: 1.0 keeps the nodes of the largest tensors and the paths between them: a block's MLP
# interior (grown along the tokens, a region runs on through the residual into the next
# block's projections, which copied with it were kept whole in the backward)
SHARES = (0.0, 0.25, 1.0)
CONV_BACKWARD = "aten.convolution_backward.default"
# NOTE: the kinds of candidate, each with half the screens of a round
COPIES, PLAIN = "copies", "plain"

# NOTE: (graph, parts, deadline) -> the split graph
Recipe = Callable[[Graph, int, float], Graph]


def _parts(region: Region, parts: int = PARTS) -> int:
    """``parts``, or fewer where the split axis has fewer units: a linear layer's rows are
    its batch and tokens merged, cut only along the batch (two units at batch 2)."""
    return min(parts, region.length)


def _held(graph: Graph, region: Region, sim: SimResult, peak_node: int | None = None) -> int:
    """Bytes live at the peak in storages the region holds along its split dim, and the peak
    node's workspace where the region runs that node in parts."""
    live = sim.peak_live
    sts = {graph.values[v].storage for v, d in region.dims.items() if isinstance(d, int)}
    held = sum(graph.storages[st].nbytes for st in sts & live)
    # NOTE: HuBERT's peak is a convolution's backward whose workspace (6.2 MiB) is larger than
    # any tensor live beside it: a region along the time that runs it in parts was ranked below
    # two along the channels that did not, and never planned (1.93x -> 1.74x once planned)
    if peak_node is not None and peak_node in region.nodes:
        held += sim.breakdown.get("workspace", 0)
    return held


def _held_separated(graph: Graph, sep: Graph, start: tuple[int, int], sim: SimResult,
                    peak_node: int | None) -> int:
    """``_held`` of the tightest region grown from ``start`` in ``sep`` (``graph`` with its
    convolutions' input gradients separated, as a re-made region grows: ``copies_regions``);
    0 where nothing was separated.

    NOTE: along HuBERT's time, a region in the captured graph ends at the first convolution
    backward (its input gradient's parts overlap) and held 2.9 MB at the peak, ranked below
    three along the channels (11.5, 7.2, 2.9 MB) that never planned below 21 MB; separated,
    it runs the peak convolution backward in parts and takes off its workspace (19.1 MB)."""
    if sep is graph:
        return 0
    # NOTE: separating adds nodes, not values: the region's values are ``graph``'s
    t = trimmed(sep, grow_region(sep, start[0], start[1]), 1.0)
    held = _held(graph, t, sim)
    if peak_node is not None:
        name = graph.nodes[peak_node].name
        if any(sep.nodes[n].name in (f"{name}.input", f"{name}.weight") for n in t.nodes):
            held += sim.breakdown.get("workspace", 0)
    return held


def candidates(graph: Graph, best: Solution) -> list[tuple[str, str, tuple[int, int], Recipe]]:
    """(what, kind (``COPIES`` or ``PLAIN``), the (value, dim) its region grows from (a
    re-made region: the forward one), its recipe) for the regions at ``best``'s peak,
    best-ranked first; ``recipe(graph, parts, deadline)`` makes the split graph."""
    starts = peak_starts(graph, best.plan, best.sim, MAX_STORAGES, peak_inputs=True)
    pc = best.sim.peak_instruction
    peak_node = getattr(best.plan[pc], "node", None) if pc >= 0 else None
    ranked = []
    seen: set = set()
    made_by = storage_producer(graph)
    convs = [n.id for n in graph.nodes if n.target == CONV_BACKWARD]
    sep = separate_input_grads(graph, convs) if convs else graph

    for i, (r, share) in enumerate(shared_regions(graph, starts, SHARES)):
        held = _held(graph, r, best.sim, peak_node)
        if not held or r.length < 2:
            continue
        # NOTE: regions cut in at least half PARTS first, then by what the parts take off: a
        # region split in halves along the batch, tried first, took the tries from one along
        # the rows in eighths (BEiT's and Gemma-2's attention, kept at a higher peak). Ranked
        # after every region in PARTS, ALBERT's attention along its 4 heads was never screened
        # (its least peak 1.40x the lower bound; re-made a head at a time, 1.24x)
        few = 2 * _parts(r) < PARTS
        held -= held // _parts(r)
        v = graph.values[r.start[0]]
        start = _forward_start(graph, r, made_by)
        # NOTE: the copies recipe trims the forward region it grows from the start, not ``r``:
        # every trim of it is a candidate. From HuBERT's second convolution backward along the
        # time (a region of two backward nodes, untrimmed), only the untrimmed copy was
        # offered, which re-made the first layer's 3.1 MiB output whole (26.4 MB); the
        # tightest re-makes the second layer's output in parts alone (22.0 MB)
        if start is not None:
            # NOTE: ranked by what its largest tensors hold, the tightest region first:
            # every share of one start holds them, and a larger region copies more
            big = _held(graph, trimmed(graph, r, 1.0), best.sim, peak_node)
            big = max(big, _held_separated(graph, sep, r.start, best.sim, peak_node))
        for copy_share in SHARES if start is not None else ():
            u = graph.values[start[0]]
            key = ("copies", graph.nodes[u.producer].target, u.shape, start[1], copy_share)
            if key not in seen:
                seen.add(key)
                what = (f"{u.name} dim {start[1]} re-made in the backward in up to {PARTS} "
                        f"parts, in every block alike (share {copy_share})")
                ranked.append((few, -(big - big // _parts(r)), -copy_share, i, what, COPIES,
                               start, copies_recipe(u.name, start[1], copy_share)))
        what = f"{len(r.nodes)} nodes from {v.name} dim {r.start[1]} in {_parts(r)} parts"
        alike = _alike_starts(graph, v.id)
        # NOTE: not from a part of an earlier split (its alikes are every block's parts)
        if (len(alike) > 1 and ".part" not in v.name
                and all(graph.nodes[n].phase is Phase.BACKWARD for n in r.nodes)):
            # NOTE: each block's backward peaks alike: splitting one per round only moves the
            # peak to the next block's (BERT's MLP backward, four rounds for four blocks)
            ranked.append((few, -held, 0, i - 0.5, what + ", in every block alike", PLAIN,
                           r.start, alike_split_recipe(v.name, r.start[1], share)))
        full = r.length >= v.shape[r.start[1]]
        ranked.append((few, -held, 0, i, what, PLAIN, r.start,
                       plain_recipe(v.name, r.start[1], share, full)))
    ranked.sort(key=lambda c: c[:4])
    return [c[4:] for c in ranked]


def copies_recipe(name: str, dim: int, share: float) -> Recipe:
    """Re-makes the forward region grown from value ``name`` along ``dim`` in the backward,
    in parts, and so for every alike start (each its own region: blocks differ in their
    edges, as BERT's first layer reads the expanded attention mask the others share)."""
    def rewrite(g: Graph, v: int, parts: int) -> Graph:
        return _copied_in_parts(g, v, dim, share, parts, forward=False)

    def forward(g: Graph, v: int, parts: int) -> Graph:
        return _forward_in_parts(g, g.values[v].name, dim, parts)
    recipe = _for_each_alike(name, rewrite, forward)
    # NOTE: the next looser trim of the same start (None: the untrimmed region), which the
    # search tries where its rounds stall (``fission_backward._widened``)
    looser = [s for s in SHARES if s < share]
    recipe.share = share
    recipe.wider = (lambda: copies_recipe(name, dim, max(looser))) if looser else None
    recipe.widens = lambda g: bool(looser) and _widens(g, name, dim, share, max(looser))
    return recipe


def _widens(graph: Graph, name: str, dim: int, share: float, looser: float) -> bool:
    """Whether the looser trim re-makes more forward nodes than ``share`` from value ``name``
    (true where the start is not in ``graph``: made by an earlier split, let it be tried)."""
    try:
        v = _value(graph, name)
    except FissionError:
        return True
    wider, tight = (forward_nodes(graph, v, dim, s, PARTS)[0] for s in (looser, share))
    return set(wider) != set(tight)


def alike_split_recipe(name: str, dim: int, share: float) -> Recipe:
    """Splits the region grown from value ``name`` along ``dim`` (trimmed to ``share``) and
    so the region of every alike start."""
    def rewrite(g: Graph, v: int, parts: int) -> Graph:
        r = grow_region(g, v, dim)
        r = trimmed(g, r, share) if share else r
        if r.length < 2:
            raise FissionError(f"{g.values[v].name}: {r.length} units")
        return split_region(g, r, _parts(r, parts), verify=True)
    return _for_each_alike(name, rewrite)


def plain_recipe(name: str, dim: int, share: float, full: bool) -> Recipe:
    """Splits the region grown from value ``name`` along ``dim`` (the one that keeps the axis's
    every unit where ``full`` and the maximal one makes it coarser), trimmed to ``share``:
    the region ``shared_regions`` yields for that start and share."""
    def make(g: Graph, parts: int, deadline: float) -> Graph:
        v = _value(g, name)
        r = grow_region(g, v, dim)
        if full and r.length < g.values[v].shape[dim]:
            r = grow_region(g, v, dim, keep_length=True)
        r = trimmed(g, r, share) if share else r
        if len(r.nodes) < 2 or r.length < 2:
            raise FissionError(f"{name}: {len(r.nodes)} nodes, {r.length} units")
        return split_region(g, r, _parts(r, parts), verify=True)
    return make


def _value(graph: Graph, name: str) -> int:
    found = next((v.id for v in graph.values if v.name == name), None)
    if found is None:
        raise FissionError(f"no value {name} in the graph")
    return found


def _forward_start(graph: Graph, region: Region,
                   made_by: dict[int, int | None] | None = None) -> tuple[int, int] | None:
    """The largest forward value the region runs in parts, and its dim (None: none); of
    equal ones, the region's own start, then one that is not a view (made by the node that
    makes its storage; ``made_by``: ``storage_producer(graph)``), then the first made.

    NOTE: attention's forward makes many tensors of one size (its input in windows, scores,
    softmax, probabilities, their copies in other layouts). At Swin's peak, the region grown
    from the softmax (held for the backward) took the first of them, the windows of the
    block's input: re-made from there, the whole block was (1.50x the lower bound). From the
    softmax itself, the attention is re-made in parts: the sweep's smallest went from 1.25x
    to 1.16x.

    NOTE: not a view: from ALBERT's attention backward along the heads, the first made was the
    query seen in heads (a transpose of its projection): re-made from there, ALBERT's least
    peak was 11.68 MB; from the attention's output (the kernel's own tensor), 8.97 MB."""
    own = region.start[0]
    made_by = storage_producer(graph) if made_by is None else made_by
    found = [(u.nbytes, v == own, made_by[u.storage] == u.producer, -v, d)
             for v, d in region.dims.items() if isinstance(d, int)
             for u in (graph.values[v],)
             if u.producer is not None and graph.nodes[u.producer].phase is Phase.FORWARD]
    if not found:
        return None
    *_, v, d = max(found)
    return -v, d


def _for_each_alike(name: str, rewrite, then=None) -> Recipe:
    """The recipe applying ``rewrite(g, value id, parts)`` to value ``name`` and, in turn, to
    each alike start's (found by name in the graph the last rewrite returned), the last
    block's first, then ``then(g, value id, parts)`` to each rewritten one, the first block's
    first; an alike start that cannot be rewritten is left as it is, ``name``'s own error is
    raised where none can, and FissionError past the deadline."""
    def make(graph: Graph, parts: int, deadline: float) -> Graph:
        # NOTE: in the backward's order, last block first. Where blocks share a tensor (T5's
        # position bias, added to every block's scores), its gradient sums every block's, and
        # a block's region takes in the sum's nodes it feeds. Grown first, block 2's took its
        # sum with block 3's gradient as a whole input: block 3's region then made that
        # gradient in parts into a whole [B, H, T, T] buffer (2 MiB) that lived through block
        # 2's backward. Last first, each block's region sums its own part: T5's smallest
        # peak went from 1.29x to 1.20x the lower bound. Each forward is then run in parts
        # in the forward's order, as before (last first, a block's forward region took in
        # the next block's softmax and left it whole)
        names = [graph.values[v].name
                 for v in reversed(_alike_starts(graph, _value(graph, name)))]
        g, done, failed = graph, [], None
        for k, other in enumerate(names):
            # NOTE: each rewrite walks the whole graph: an unrolled GRU's 256 steps are alike
            # (23,615 nodes: hours for one candidate)
            if planning_now() > deadline:
                raise FissionError(f"out of time after {k} of {len(names)} alike starts")
            if done and not any(v.name == other for v in g.values):
                continue   # NOTE: a region grown from a later block's start took it in
            if done and _re_made(g, other):
                # NOTE: an earlier start's region re-made it (a block's scores and its
                # probabilities are alike: both bmm): re-made twice, Swin's attention was
                continue
            try:
                g = rewrite(g, _value(g, other), parts)
                done.append(other)
            except (FissionError, CopyError, GraphError, StopIteration) as e:
                # NOTE: where a later block's rewrite re-made this one's region too (a chain
                # of row-wise blocks grows into one region), there is nothing left to re-make
                if other == name:
                    failed = e
        if not done:
            raise failed or FissionError(f"{name}: no alike start could be rewritten")
        # NOTE: then each rewritten start's ``then`` (its forward run in parts), in the
        # forward's order, first block first
        for other in reversed(done) if then is not None else ():
            if any(v.name == other for v in g.values):
                g = then(g, _value(g, other), parts)
        return g
    return make


def products_folded(graph: Graph) -> Graph:
    """``graph`` with each part's products summed into one tensor and those into the parts'
    accumulators (``transform.products_into_sums``, then ``sums_in_place``): for a path's
    graph once all its splits are made.

    NOTE: folded as each block was split, the next block's region grew otherwise: the toy
    attention of ``tests/test_products_into_sums.py`` kept its first layer's query and key
    gradients whole (205 KB planned against 192 unfolded); folded once at the end, 172 KB."""
    return sums_in_place(products_into_sums(graph))


def _re_made(graph: Graph, name: str) -> bool:
    """Whether ``graph`` has a copy of value ``name`` in the backward (whole or in parts)."""
    copy = name + COPY_SUFFIX
    return any(v.name == copy or v.name.startswith(copy + ".") for v in graph.values)


def _alike_starts(graph: Graph, vid: int) -> list[int]:
    """Values made by the same op in the same phase, of the same shape, at the same output
    index."""
    v = graph.values[vid]
    n = graph.nodes[v.producer]
    at = n.outputs.index(vid)
    out = []
    for m in graph.nodes:
        if (m.phase is n.phase and m.target == n.target and len(m.outputs) > at
                and m.outputs[at] is not None and graph.values[m.outputs[at]].shape == v.shape):
            out.append(m.outputs[at])
    return out


def _copied_in_parts(graph: Graph, vid: int, dim: int, share: float, parts: int = PARTS,
                     forward: bool = True) -> Graph:
    """``graph`` with the forward region grown from ``vid`` along ``dim`` re-made in the
    backward and run there in up to ``parts`` parts with the backward ops that read it (and
    its readers past that region in parts of their own: ``copies_regions``)."""
    fwd, min_length = forward_nodes(graph, vid, dim, share, PARTS)
    nodes = copy_set(graph, fwd)
    name = graph.values[vid].name + COPY_SUFFIX
    made = copies_region(graph, nodes, name, dim, min_length)
    try:
        out = split_region(made.graph, made.region, _parts(made.region, parts), verify=True)
        if made.late:
            out = late_copies(out, made, _parts(made.region, parts))
    except (FissionError, CopyError, GraphError):
        if not made.late:
            raise
        # NOTE: the readers past the region read its copies whole, as they were
        made = copies_region(graph, nodes, name, dim, min_length, late=False)
        out = split_region(made.graph, made.region, _parts(made.region, parts), verify=True)
    _check_views(out)
    return _forward_in_parts(out, graph.values[vid].name, dim, parts) if forward else out


def _forward_in_parts(graph: Graph, name: str, dim: int, parts: int = PARTS) -> Graph:
    """``graph`` with the forward region grown from value ``name`` along ``dim`` (forward
    nodes only) run in up to ``parts`` parts too; ``graph`` itself where it cannot be.

    Once the backward reads the copies, the forward region's own tensors are read by forward
    nodes alone: its parts die in the forward, so splitting it costs no saved tensor and cuts
    the forward's peak (a block's scores and softmax, whole, in every forward)."""
    vid = next((v.id for v in graph.values if v.name == name), None)
    if vid is None:
        return graph
    out_of_forward = {n.id: "not in the forward" for n in graph.nodes
                      if n.phase is not Phase.FORWARD}
    # NOTE: a forward node whose storages the backward reads (through any view) stays whole:
    # its parts would be saved for the backward. A shape-only reader reads no values: the
    # backward's ``ones_like(loss)`` kept the loss whole, and with it ALBERT's 2 MiB
    # log-probabilities, assembled from their parts for it (1.44x the lower bound -> 1.40x)
    later = {graph.values[v].storage for n in graph.nodes if n.phase is not Phase.FORWARD
             and n.target not in SHAPE_ONLY for v in n.inputs}
    saved = {n.id: "read by the backward" for n in graph.nodes if n.phase is Phase.FORWARD
             and any(graph.values[o].storage in later for o in n.outputs if o is not None)}
    if graph.values[vid].producer in saved:
        return graph
    exclude = out_of_forward | saved
    coarse = _own_region(graph, vid, dim, exclude)
    # NOTE: of the region grown and the one that keeps every unit of the axis (a reshape
    # ties the flattened tokens to the batch), the one whose parts take off more: ALBERT's
    # MLP in 8 parts along its [B*T, 512] rows, not 2 along the batch with its norms; Swin's
    # attention through its windows (the region kept to the heads' rows planned 1.4% higher)
    regions = [coarse]
    if coarse.length < graph.values[vid].shape[dim]:
        regions.append(_own_region(graph, vid, dim, exclude, keep_length=True))
    region = max(regions, key=lambda r: _taken_off(graph, r, parts))
    if region.length < 2:
        return graph
    try:
        out = split_region(graph, region, _parts(region, parts), verify=True)
        _check_views(out)
    except (FissionError, CopyError, GraphError):
        return graph
    return out


def _own_region(graph: Graph, vid: int, dim: int, exclude: dict[int, str],
                **kw) -> Region:
    """The region grown from ``vid`` along ``dim``, kept to its own block
    (``forward_regions.linked_nodes``)."""
    region = grow_region(graph, vid, dim, exclude=exclude, **kw)
    own = linked_nodes(graph, graph.values[vid].producer, set(region.nodes))
    if len(own) < len(region.nodes):
        others = {n: "another block's" for n in region.nodes if n not in own}
        region = grow_region(graph, vid, dim, exclude=exclude | others, **kw)
    return region


def _taken_off(graph: Graph, region: Region, parts: int) -> int:
    """Bytes of the storages ``region`` makes along its dim, less a part's share of them."""
    if region.length < 2:
        return 0
    inside = set(region.nodes)
    sts = {graph.values[v].storage for v, d in region.dims.items()
           if isinstance(d, int) and graph.values[v].producer in inside}
    held = sum(graph.storages[st].nbytes for st in sts)
    return held - held // _parts(region, parts)


def _check_views(graph: Graph) -> None:
    """A node that allocates nothing and writes nothing (a view) must return tensors in the
    storages it reads; CopyError where one does not (the planner would free the wrong
    storage)."""
    fresh = new_storages(graph)
    for n in graph.nodes:
        if fresh[n.id] or n.mutates:
            continue
        read = {graph.values[v].storage for v in n.inputs}
        for o in n.outputs:
            if o is not None and graph.values[o].storage not in read:
                raise CopyError(f"{n.name} returns {graph.values[o].name} in a storage it "
                                "does not read")
