"""``ProfiledCostModel``: node latency and workspace measured on this machine, cached in SQLite.

Every distinct node (op + input layouts + constant arguments) is run standalone on synthetic
inputs: warm-up runs, then the median of timed runs, then one run under ``MemoryMeter`` for its
workspace. Results go to the ``CostCache`` keyed by a hash that also holds the device, torch
version and thread count, so profiling a graph twice (or a graph that shares ops with an
earlier one, in any process) measures nothing new.

Example:
    >>> import torch, fitgraph, tempfile
    >>> from fitgraph.cost import ProfiledCostModel
    >>> model = torch.nn.Linear(8, 4)
    >>> g = fitgraph.capture(model, torch.randn(2, 8), lambda m, b: m(b).sum())
    >>> cm = ProfiledCostModel(cache=tempfile.mkdtemp(), repeats=2, warmup=1, progress=False)
    >>> cm.profile(g) > 0, cm.profile(g)
    (True, 0)
    >>> cm.node_cost(g, g.nodes[0]).seconds > 0
    True

Synthetic inputs: floating tensors are ``torch.rand`` (uniform in [0, 1), so sqrt/log/
multinomial stay valid), integers are zeros (valid indices and labels), bools are ones, except
random bits (a dropout mask kept as bits), drawn at their density (``cost/drawn_bits.py``), and
opaque byte buffers (an LSTM's oneDNN workspace, a cuDNN reserve): a node reading one runs after
the nodes that make it, on their real outputs (``cost/opaque.py``). A node that fails alone on
synthetic inputs is measured again after all its producers, on their real outputs (a
``cholesky_ex(check_errors=True)`` of a matrix the step makes positive-definite); only if that
fails too is profiling an error. ``Measurement.inputs`` and ``priced_apart`` say which nodes
were measured how. Inputs
that share a storage in the graph share one here, with the graph's strides and offsets. Nodes
that write their inputs in place get freshly made inputs before every run, so repeated runs
never drift (to denormals, overflow) and every run does the same work. All of this happens
under ``torch.random.fork_rng``: profiling never shifts the caller's random stream.

Measured inputs are already written; where the real step writes first into memory an
``empty``/``empty_like`` just allocated (dropout's mask), ``node_cost`` adds the page faults the
profile never saw (``cost/first_touch.py``, measured once per machine; on the CPU, whose freed
memory the model keeps mapped, ``execute/host_memory.py``, only for blocks of 32 MiB or more).

In situ (the default on a CPU): every node is also timed inside its graph's eager step
(``cost/in_situ.py``), and ``node_cost`` charges that time: an op alone runs with warm caches
and recycled blocks, and small ops gain more from that than large ones, so the alone-times
mislead a choice between a step and its parts. Workspaces stay the alone-measurement's.

Workspace: ``peak - fresh``, where peak is the meter's peak over the node's run (inputs already
allocated, outputs still alive at exit) and fresh is the bytes of the storages the IR says the
node allocates (``new_storages``). The meter's ``end_bytes`` — what the node really left
allocated — is stored too; where it differs from fresh, the IR's alias model disagrees with
the real op (see ``alias_mismatches``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch

from ..execute.host_memory import MMAP_CEILING_BYTES, kept
from ..execute.host_memory import keep_host_memory as keep_warm
from ..execute.meter import MemoryMeter
from ..execute.synthetic import OPTIMIZER_PREFIX, SyntheticRunner
from ..graph.analysis import new_storages
from ..graph.ir import Graph, Node, ValueRef
from .base import BaseCostModel, NodeCost
from .cache import CacheEntry, CostCache
from .clock import measuring
from .drawn_bits import bit_densities
from .first_touch import measure_seconds_per_byte, untouched_writes
from .in_situ import check_cache, profile_in_situ
from .opaque import OpaqueInputs, opaque_inputs, producers

__all__ = ["Measurement", "NotProfiledError", "ProfiledCostModel", "cpu_model", "node_signature"]

log = logging.getLogger(__name__)

# NOTE: bump when what is measured or how changes, so old cache entries are not reused
# (2: fitgraph.backend had measured under AOTAutograd's FakeTensorMode, see ``profile``)
_KEY_VERSION = 2
_CHUNKS = ("chunks",)  # transform.optimizer_chunks: changes the update's temporaries
_OPTIMIZER_KWARGS = ("hyper", "state_keys", "have")  # not "group"/"param": they don't change cost
# NOTE: copy bandwidth is fitted from two sizes: a small one (fixed latency dominates) and a
# large one (bandwidth dominates; 64 MiB is far beyond any cache level)
_COPY_SMALL = 4096
_COPY_LARGE = 64 * 2**20
_COPY_REPEATS = 5
_BLANK_MEMO = 64   # graphs whose untouched writes are remembered
AFTER_PRODUCERS = ("after its producers, on their real outputs (alone on synthetic inputs "
                   "it failed)")


class NotProfiledError(KeyError):
    """``node_cost`` was asked for a node that was never measured."""

    def __str__(self) -> str:  # NOTE: KeyError's str() would quote the whole message
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class Measurement:
    """Everything measured for one node (cached entries included)."""

    key: str
    seconds: float
    workspace_bytes: int
    end_bytes: int      # allocator bytes the node left allocated (its real fresh outputs)
    fresh_bytes: int    # bytes of the storages the IR says the node allocates
    inputs: str = "synthetic"  # how its inputs were made ("after ...": cost/opaque.py)

    @property
    def alias_mismatch(self) -> bool:
        """True when the real op allocated a different amount than the IR's alias model says."""
        return self.end_bytes != self.fresh_bytes


def _canon(obj, pos: dict[int, int]) -> str:
    """Deterministic text of a constant argument; ValueRefs become input positions (%i)."""
    if isinstance(obj, ValueRef):
        return f"%{pos[obj.id]}"
    if isinstance(obj, tuple):
        return "(" + ",".join(_canon(o, pos) for o in obj) + ")"
    if isinstance(obj, list):
        return "[" + ",".join(_canon(o, pos) for o in obj) + "]"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k!r}:{_canon(obj[k], pos)}" for k in sorted(obj, key=str)) + "}"
    text = repr(obj)
    if " at 0x" in text:  # NOTE: an address would make the key differ in every process
        raise TypeError(f"constant argument {text} has no deterministic repr; fitgraph cannot "
                        "key its measurement (report this op)")
    return text


def node_signature(graph: Graph, node: Node, densities: dict[int, float] | None = None,
                   opaque: dict[int, int] | None = None) -> str:
    """The device-independent part of a node's cache key: op, input layouts, constants, the
    density of random bits an input holds (``densities``: ``cost.drawn_bits``), and the op
    that made an opaque input (``opaque``: storage -> node, ``cost.opaque``).

    Two nodes with equal signatures run the same kernel on the same layouts, so one
    measurement serves both (the many ``aten.t`` / ``detach`` nodes of a graph, the layers of
    a deep stack).
    """
    pos = {vid: i for i, vid in enumerate(node.inputs)}
    first_of_storage: dict[int, int] = {}
    ins = []
    for i, vid in enumerate(node.inputs):
        v = graph.values[vid]
        share = first_of_storage.setdefault(v.storage, i)  # NOTE: aliasing between inputs
        ins.append(f"{v.dtype}{list(v.shape)}/{list(v.stride)}+{v.storage_offset}@{share}")
        if densities and v.storage in densities:  # NOTE: bits drawn at random, not ones
            ins[-1] += f"~p{densities[v.storage]:.3g}"
        if opaque and v.storage in opaque:  # NOTE: real bytes of its maker, not synthetic
            ins[-1] += f"~by:{graph.nodes[opaque[v.storage]].target}"
    if node.target.startswith(OPTIMIZER_PREFIX):
        # NOTE: "chunks" only where set: unchunked updates keep the keys cached before it
        consts = _canon({k: node.kwargs[k] for k in _OPTIMIZER_KWARGS + _CHUNKS
                         if k in node.kwargs}, pos)
    else:
        consts = _canon(node.args, pos) + _canon(node.kwargs, pos)
    if opaque and node.id in opaque.values():
        # NOTE: measured with its buffer since it runs in grad mode and the buffer counts as
        # output: keyed apart from entries cached before (made under no_grad, no buffer)
        consts += "|makes-opaque"
    return f"{node.target}|{';'.join(ins)}|{consts}"


class ProfiledCostModel(BaseCostModel):
    measures = True

    """Costs measured on ``device`` ("cpu", "cuda", "cuda:1"), cached across processes.

    Args:
        device: where nodes are run.
        cache: a ``CostCache``, a directory or ``.sqlite`` file; None = the default cache
            (``$FITGRAPH_CACHE_DIR`` or the user cache dir).
        repeats: timed runs per node (the median is kept).
        warmup: untimed runs first (lazy kernel initialisation, caches, cuDNN autotuning).
        progress: show a tqdm bar over the nodes being measured.
        refresh: measure again even what the cache holds, and overwrite it. Without it, the
            first graph profiled, where the cache holds its in-situ times, is timed in its step
            once and compared (``cost/in_situ.check_cache``): where the cache reads over 1.5x
            (or under 1/1.5x) what its ops take now (a profile taken while other work shared
            the machine), a warning says so and ``refresh`` turns on (``stale_cache_ratio``
            keeps the ratio).
        in_situ: also time every node inside its graph's eager step (``cost/in_situ.py``) and
            cost it by that time: ops alone run with warm caches and recycled blocks, and
            small ops gain more from it than large ones. A graph timed after others is timed
            against the nodes it shares with them (``in_situ.on_basis``: the machine's speed
            drifts between profiles). Default: on the CPU.

    Measurements are valid for this device, torch version and ``torch.get_num_threads()`` (all
    part of the key): change the thread count and the graph must be profiled again. Nodes and
    values are treated as immutable once keyed.
    """

    def __init__(self, device: str | torch.device = "cpu",
                 cache: CostCache | str | os.PathLike | None = None, repeats: int = 5,
                 warmup: int = 2, progress: bool = True, refresh: bool = False,
                 in_situ: bool | None = None, keep_host_memory: bool = False) -> None:
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"ProfiledCostModel(device={str(device)!r}): CUDA is not "
                                   "available; profile on 'cpu' or use a RooflineCostModel")
            dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None
                               else dev.index)
        elif dev.type != "cpu":
            raise ValueError(f"ProfiledCostModel supports 'cpu' and 'cuda' devices, got {dev}")
        if repeats < 1 or warmup < 0:
            raise ValueError("ProfiledCostModel needs repeats >= 1 and warmup >= 0")
        if in_situ and dev.type != "cpu":
            raise ValueError("in_situ times ops inside the step one by one, which on CUDA would "
                             "serialise its asynchronous kernels: use in_situ=False there")
        self.in_situ = dev.type == "cpu" if in_situ is None else in_situ
        self.device = dev
        if dev.type == "cpu" and keep_host_memory:
            # NOTE: steps then reuse warm memory, as the profile does (opt-in: it changes the
            # whole process's malloc; execute/host_memory.py)
            keep_warm()
        # NOTE: on the CPU the executor copies in line, and "host" is the same RAM
        self.copies_overlap = self.host_memory_apart = dev.type == "cuda"
        self.cache = cache if isinstance(cache, CostCache) else CostCache(cache)
        self.repeats, self.warmup, self.progress = repeats, warmup, progress
        self.refresh = refresh
        self.stale_cache_ratio: float | None = None
        self._cache_checked = False
        # NOTE: bytes of one generator-state tensor: the transient of an RNG replay
        self.rng_state_bytes = (torch.default_generator.get_state().numel() if dev.type == "cpu"
                                else torch.cuda.default_generators[dev.index].get_state().numel())
        self.label, self.hardware = _describe(dev)
        self._entries: dict[str, CacheEntry] = {}
        self._situ: dict[str, float] = {}   # key -> seconds in its step (cost/in_situ.py)
        self._apart: dict[str, str] = {}    # key -> how, where measured after its producers
        # id(node) -> (node, signature, env, key): keys are asked for on every node_cost call
        self._keys: dict[int, tuple[Node, str, str, str]] = {}
        self._constants: dict[tuple, tuple[float, ...]] = {}  # (env, names) -> values
        # id(graph) -> (graph, untouched writes, random-bit densities, opaque inputs)
        self._blank: dict[int, tuple[Graph, dict[int, int], dict[int, float],
                                     OpaqueInputs]] = {}

    # -- keys -----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        n = torch.get_num_threads()
        version = torch.__version__.split("+")[0]
        return f"{self.label} (measured, torch {version}, {n} thread{'s' if n != 1 else ''})"

    def _env(self) -> str:
        return (f"v{_KEY_VERSION}|{self.hardware}|torch {torch.__version__}|"
                f"threads {torch.get_num_threads()}")

    def key(self, graph: Graph, node: Node) -> str:
        """The cache key of ``node`` here and now (a sha256 hex digest)."""
        env = self._env()
        memo = self._keys.get(id(node))
        if memo is not None and memo[0] is node and memo[2] == env:
            return memo[3]
        if memo is not None and memo[0] is node:
            sig = memo[1]
        else:
            _, densities, opaque = self._graph_facts(graph)
            sig = node_signature(graph, node, densities, opaque.storages)
        key = hashlib.sha256(f"{sig}||{env}".encode()).hexdigest()
        self._keys[id(node)] = (node, sig, env, key)
        return key

    def measured_ratio(self, graph: Graph, plan, other_graph: Graph, other_plan,
                       undecided=None) -> float:
        """``plan``'s step on ``graph`` over ``other_plan``'s on ``other_graph``, measured here
        (the median of paired rounds, ``cost.plan_timing``; more rounds while
        ``undecided(median)`` says it is too close to call); not planning time
        (``measuring``). A solver choosing between plans on simulated times confirms the
        choice with it."""
        from .plan_timing import plans_ratio

        with measuring():
            return plans_ratio(graph, plan, other_graph, other_plan, self,
                               undecided=undecided)[0]

    # -- the CostModel protocol -----------------------------------------------------------------
    def node_cost(self, graph: Graph, node: Node) -> NodeCost:
        key = self.key(graph, node)
        e = self._entry(key, node)
        situ = self._situ.get(key)
        if situ is not None:  # NOTE: timed in its step, page faults included
            return NodeCost(situ, e.workspace_bytes)
        blank = self._untouched_bytes(graph).get(node.id, 0)
        if blank:  # NOTE: page faults the profile never saw (cost/first_touch.py)
            return NodeCost(e.seconds + blank * self.first_touch_seconds_per_byte(),
                            e.workspace_bytes)
        return NodeCost(e.seconds, e.workspace_bytes)

    def _untouched_bytes(self, graph: Graph) -> dict[int, int]:
        return self._graph_facts(graph)[0]

    def _graph_facts(self, graph: Graph
                     ) -> tuple[dict[int, int], dict[int, float], OpaqueInputs]:
        """(node -> untouched bytes it writes first, bool storage -> random-bit density,
        the opaque byte buffers and what makes them)."""
        memo = self._blank.get(id(graph))
        if memo is None or memo[0] is not graph:
            if len(self._blank) >= _BLANK_MEMO:  # NOTE: fission plans many graphs; keep few
                self._blank.clear()
            floor = MMAP_CEILING_BYTES if self.device.type == "cpu" and kept() else 0
            memo = self._blank[id(graph)] = (graph, untouched_writes(graph, floor),
                                             bit_densities(graph), opaque_inputs(graph))
        return memo[1], memo[2], memo[3]

    def first_touch_seconds_per_byte(self) -> float:
        """Page-fault seconds per byte written first into fresh memory (CPU; 0 on CUDA, whose
        caching allocator reuses mapped memory), measured once per machine and cached."""
        if self.device.type != "cpu":
            return 0.0
        return self._machine_constants(("first-touch-seconds-per-byte",),
                                       lambda: (measure_seconds_per_byte(),))[0]

    def copy_seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        latency, per_byte = self._copy_params()
        return latency + nbytes * per_byte

    # -- profiling ------------------------------------------------------------------------------
    def prepare(self, graph: Graph) -> None:
        self.profile(graph)

    def profile(self, graph: Graph) -> int:
        """Measure every distinct node of ``graph`` not in the cache; return how many were.

        NOTE: on real tensors, whatever dispatch mode the caller is in: ``fitgraph.backend``
        plans inside AOTAutograd's FakeTensorMode, where the ops ran on fake tensors (nothing
        allocated, no kernel run: wav2vec2's convolution backwards measured 0 B of workspace
        for 6.2 MiB, in a tenth of their time), and those numbers went to the cache."""
        from torch.utils._python_dispatch import _disable_current_modes

        # NOTE: not planning time: a solver's deadline reads the planning clock (cost.clock),
        # so a plan does not depend on which ops the cache already held
        with _disable_current_modes(), measuring():
            return self._profile(graph)

    def _profile(self, graph: Graph) -> int:
        if not self._cache_checked:
            self._cache_checked = True  # NOTE: once: what this process measures is fresh
            check_cache(self, graph)
        todo: dict[str, Node] = {}
        for node in graph.nodes:
            todo.setdefault(self.key(graph, node), node)
        missing = [k for k in todo if k not in self._entries]
        if not self.refresh:
            self._entries.update(self.cache.get_many(missing))
            marks = self.cache.get_many([_after_key(k) for k in missing])
            self._apart.update((k, AFTER_PRODUCERS) for k in missing if _after_key(k) in marks)
        todo = {k: n for k, n in todo.items() if k not in self._entries}
        self._copy_params()
        self.first_touch_seconds_per_byte()
        if todo:
            self._profile_alone(graph, todo)
        self._size_opaque(graph)
        if self.in_situ:
            profile_in_situ(self, graph)
        return len(todo)

    def _size_opaque(self, graph: Graph) -> None:
        """Opaque buffers captured shorter than their makers really allocate get the measured
        size (``cost/opaque.py``), so the simulator counts them while they live."""
        opaque = self._graph_facts(graph)[2]
        if not opaque.storages:
            return
        fresh = new_storages(graph)
        for nid in sorted(set(opaque.storages.values())):
            node = graph.nodes[nid]
            e = self._entry(self.key(graph, node), node)
            added = opaque.resize(nid, e.end_bytes,
                                  sum(graph.storages[s].nbytes for s in fresh[nid]))
            if added:
                log.info("node %s (%s): its opaque buffer is %d bytes larger than captured "
                         "(measured); the plan counts the measured size", node.name,
                         node.target, added)

    def _profile_alone(self, graph: Graph, todo: dict[str, Node]) -> None:
        """Measure the nodes of ``todo`` (key -> node) one by one, alone."""
        fresh = new_storages(graph)
        _, densities, opaque = self._graph_facts(graph)
        runner = SyntheticRunner(graph, self.device, densities, opaque.chains)
        from tqdm import tqdm

        from .. import progress

        # NOTE: a bar where asked, or where a caller listens on the terminal (fitgraph.progress)
        bar = tqdm(todo.items(), desc=f"profiling on {self.label}", unit="op",
                   disable=None if self.progress or progress.on_terminal() else True)
        mismatched = []
        rng_devices = [self.device.index] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), torch.no_grad():
            torch.manual_seed(0)  # NOTE: synthetic inputs are the same in every process
            for key, node in bar:
                fresh_bytes = sum(graph.storages[s].nbytes for s in fresh[node.id])
                try:
                    seconds, peak, end = self._measure(runner, node)
                except RuntimeError as e:
                    seconds, peak, end = self._measure_after_producers(graph, runner, key,
                                                                       node, e)
                if node.id in opaque.storages.values() and len(opaque.makes(node.id)) == 1:
                    # NOTE: its opaque buffer's real size is output, not workspace (_size_opaque)
                    fresh_bytes = max(fresh_bytes, end)
                entry = CacheEntry(seconds, max(0, peak - fresh_bytes), end)
                self.cache.put(key, entry, device=self.hardware,
                               torch_version=torch.__version__, target=node.target)
                self._entries[key] = entry
                if end != fresh_bytes:
                    mismatched.append(node)
                    log.debug("node %s (%s): allocator kept %d bytes, the IR says it allocates "
                              "%d", node.name, node.target, end, fresh_bytes)
        if mismatched:
            log.info("%d profiled nodes left a different number of bytes allocated than the "
                     "IR's alias model predicts: %s (see ProfiledCostModel.alias_mismatches)",
                     len(mismatched), sorted({n.target for n in mismatched}))

    def _measure_after_producers(self, graph: Graph, runner: SyntheticRunner, key: str, node: Node,
                                 error: RuntimeError) -> tuple[float, int, int]:
        """``_measure`` again with every producer of ``node`` run first (its inputs real);
        recorded (and cached) as how the node was measured. Raises naming both failures."""
        chain = producers(graph, node.id)
        if not chain or runner.chains.get(node.id) == chain:
            raise error
        runner.chains[node.id] = chain
        try:
            got = self._measure(runner, node)
        except RuntimeError as again:
            raise RuntimeError(f"{error}; run after its {len(chain)} producers, on their real "
                               f"outputs, it failed too: {again.__cause__}") from again
        log.info("node %s (%s) failed alone on synthetic inputs (%s); measured after its %d "
                 "producers instead", node.name, node.target, error.__cause__, len(chain))
        self._apart[key] = AFTER_PRODUCERS
        self.cache.put(_after_key(key), CacheEntry(0.0, 0, 0), device=self.hardware,
                       torch_version=torch.__version__, target="after producers")
        return got

    def _how(self, graph: Graph, node: Node, key: str) -> str:
        return self._apart.get(key) or self._graph_facts(graph)[2].describe(node.id)

    def measurement(self, graph: Graph, node: Node) -> Measurement:
        """What was measured for ``node``, with the IR's fresh bytes to compare."""
        key = self.key(graph, node)
        e = self._entry(key, node)
        fresh = sum(graph.storages[s].nbytes for s in new_storages(graph)[node.id])
        return Measurement(key, e.seconds, e.workspace_bytes, e.end_bytes, fresh,
                           self._how(graph, node, key))

    def measurements(self, graph: Graph) -> list[Measurement]:
        """``measurement`` of every node, in node order."""
        table = new_storages(graph)
        out = []
        for node in graph.nodes:
            key = self.key(graph, node)
            e = self._entry(key, node)
            fresh = sum(graph.storages[s].nbytes for s in table[node.id])
            out.append(Measurement(key, e.seconds, e.workspace_bytes, e.end_bytes, fresh,
                                   self._how(graph, node, key)))
        return out

    def priced_apart(self, graph: Graph) -> dict[str, str]:
        """Node name -> how it was measured, for the nodes not measured alone on synthetic
        inputs: those reading an opaque buffer ran after its makers (``cost/opaque.py``), those
        that failed alone after all their producers (known once ``profile`` ran). In situ
        (``in_situ``), every node is also timed in its step, on real values."""
        out = {}
        for node in graph.nodes:
            how = self._how(graph, node, self.key(graph, node))
            if how != "synthetic":
                out[node.name] = how
        return out

    def alias_mismatches(self, graph: Graph) -> list[tuple[Node, Measurement]]:
        """Nodes whose real allocation differs from the IR's (``end_bytes != fresh_bytes``)."""
        return [(n, m) for n, m in zip(graph.nodes, self.measurements(graph))
                if m.alias_mismatch]

    # -- internals ------------------------------------------------------------------------------
    def _entry(self, key: str, node: Node) -> CacheEntry:
        e = self._entries.get(key)
        if e is None:
            e = self.cache.get(key)  # NOTE: maybe profiled meanwhile by another process
            if e is None:
                raise NotProfiledError(
                    f"node {node.name} ({node.target}) has not been profiled on {self.name}; "
                    "call .profile(graph) first (a different thread count or torch version "
                    "also needs a new profile)")
            self._entries[key] = e
        return e

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, run, env: list) -> float:
        if self.device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._sync()
            start.record()
            out = run(env)
            stop.record()
            stop.synchronize()
            del out
            return start.elapsed_time(stop) / 1e3
        t0 = time.perf_counter()
        out = run(env)
        t1 = time.perf_counter()
        del out
        return t1 - t0

    def _measure(self, runner: SyntheticRunner, node: Node) -> tuple[float, int, int]:
        """(median seconds, meter peak bytes, meter end bytes) of one node."""
        run = runner.callable(node)
        mutating = bool(node.mutates)
        env = runner.inputs(node)
        try:
            for _ in range(self.warmup):
                if mutating:
                    env = runner.inputs(node)
                out = run(env)
                del out
            times = []
            for _ in range(self.repeats):
                if mutating:
                    env = runner.inputs(node)
                times.append(self._time(run, env))
            env = runner.inputs(node)  # NOTE: fresh inputs, allocated before the meter opens
            self._sync()
            with MemoryMeter(self.device) as meter:
                out = run(env)
            del out  # NOTE: after the meter closed: its end_bytes are the live outputs
        except Exception as e:
            raise RuntimeError(f"profiling node {node.name} ({node.target}) failed on synthetic "
                               f"inputs: {type(e).__name__}: {e}") from e
        return statistics.median(times), meter.peak_bytes, meter.end_bytes

    def _copy_params(self) -> tuple[float, float]:
        return self._machine_constants(("copy-latency", "copy-seconds-per-byte"),
                                       self._measure_copy)

    def _machine_constants(self, names: tuple[str, ...], measure) -> tuple[float, ...]:
        """Per-machine constants (copy latency and bandwidth, first-touch cost): from memory,
        else from the cost cache, else ``measure()`` once and cached under this key's env."""
        env = self._env()
        memo = self._constants.get((env, names))
        if memo is not None:
            return memo
        keys = [hashlib.sha256(f"{name}||{env}".encode()).hexdigest() for name in names]
        got = self.cache.get_many(keys)
        if all(k in got for k in keys):
            values = tuple(got[k].seconds for k in keys)
        else:
            values = tuple(measure())
            for k, v, name in zip(keys, values, names):
                self.cache.put(k, CacheEntry(v, 0, 0), device=self.hardware,
                               torch_version=torch.__version__, target=name.replace("-", " "))
        self._constants[(env, names)] = values
        return values

    def _measure_copy(self) -> tuple[float, float]:
        """(latency, seconds per byte) of a host<->device copy (a memcpy on CPU)."""
        t_small = self._copy_time(_COPY_SMALL)
        t_large = self._copy_time(_COPY_LARGE)
        per_byte = (t_large - t_small) / (_COPY_LARGE - _COPY_SMALL)
        if per_byte <= 0:  # NOTE: timer noise on a tiny machine; bandwidth from the large copy
            per_byte = t_large / _COPY_LARGE
        return max(0.0, t_small - _COPY_SMALL * per_byte), per_byte

    def _copy_time(self, nbytes: int) -> float:
        """Median seconds of one copy of ``nbytes`` (on CUDA: the slower direction)."""
        if self.device.type == "cpu":
            src = torch.ones(nbytes, dtype=torch.uint8)
            dst = torch.empty_like(src)
            pairs = [(dst, src)]
        else:
            host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
            dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            pairs = [(dev, host), (host, dev)]
        worst = 0.0
        for dst, src in pairs:

            def run(_env, dst=dst, src=src):
                return dst.copy_(src, non_blocking=True)

            for _ in range(2):
                run(None)
            worst = max(worst, statistics.median(self._time(run, []) for _ in
                                                 range(_COPY_REPEATS)))
        return worst

    def __repr__(self) -> str:
        return f"ProfiledCostModel({str(self.device)!r}, cache={self.cache.path})"


def _after_key(key: str) -> str:
    """The cache key marking ``key``'s node as measured after its producers."""
    return hashlib.sha256(f"after-producers|{key}".encode()).hexdigest()


def _describe(dev: torch.device) -> tuple[str, str]:
    """(short label for names, full hardware description for cache keys)."""
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        major, minor = torch.cuda.get_device_capability(dev)
        return name, f"cuda {name} sm_{major}{minor}"
    return "cpu", f"cpu {cpu_model()}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
