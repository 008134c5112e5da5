"""Fused linear cross-entropy: fitgraph's fission against a Liger-style reference, measured.

    python -m fitgraph.bench.flce_anchor [--vocab 50257 --hidden 128 --layers 2 --seq 512
                                          --batch 4 --rounds 7]

The anchors of issue 25 (finding 4) are Liger-Kernel's fused linear cross-entropy and Apple's
Cut Cross-Entropy: Triton kernels that never hold the ``tokens x vocabulary`` logits. They do
not run on a CPU, so ``flce_reference`` is a pure-PyTorch reimplementation of Liger's
algorithm (``LigerFusedLinearCrossEntropyFunction``, src/liger_kernel/ops/
fused_linear_cross_entropy.py): the tokens are cut into chunks of
``next_power_of_2(ceil(BT / ceil(V / H)))`` (Liger's rule: a chunk's logits about as large as
the hidden states); per chunk the logits ``h @ W.T (+ b)`` are made, the cross-entropy's loss
and its logits gradient computed in the forward (ignore_index, label smoothing, mean over the
tokens not ignored), written over the logits in place as Liger's kernel does, and turned at once
into ``grad_h[chunk] = g @ W`` and ``grad_W += g.T @ h`` (``grad_b += g.sum(0)``); the chunk is
then freed. The backward only scales the stored gradients by ``grad_output``.

Systems on one GPT-2-style causal LM (``transformers.GPT2LMHeadModel`` from a config, random
weights, no dropout, labels with the last eighth of each row padded to -100), one thread, AdamW:

- ``eager``: ``model(input_ids=..., labels=...).loss``, Hugging Face's own loss (full logits,
  ``.float()``, shifted labels, ``ignore_index=-100``);
- ``reference``: the model to its last hidden state, then ``flce_reference`` on the LM head's
  weight with the labels shifted as Liger's Hugging Face integration shifts them (padded with
  -100, every hidden state kept);
- ``fitgraph @ reference``: ``fitgraph.optimize`` on the eager model and its plain loss, at the
  reference's measured peak (bytes);
- with ``--chunks 128,...``: the reference again with that many tokens a chunk (Liger's rule
  is tuned for GPUs; on a CPU coarser chunks run faster), and fitgraph at each one's peak;
- ``fitgraph smallest``: at the smallest peak fitgraph reaches (``BudgetInfeasible.
  smallest_peak_bytes`` of an impossible budget), planned and run.

Peaks are measured as ``bench.harness`` measures them (resident bytes + the allocator meter's
peak, never RSS); times in paired rounds (``harness._time_rounds``: each step between two eager
steps, the median of the ratios). "vocab region" is a system's peak over the peak of the body
alone (the same model to its last hidden state with a loss of no vocabulary, measured the same
way); the issue's target is at most twice the largest block's saved activations. Every system's
first step (from the same weights and AdamW state) is compared with eager's
(``sweep_measure.compare``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "AnchorRow", "FlceReference", "flce_reference", "liger_chunk_size",
           "main", "run"]

IGNORE_INDEX = -100
PAD_SHARE = 8          # NOTE: the last 1/8 of each row's labels is padding (ignore_index)
SEED = 0
LR = 1e-4
# NOTE: the body-alone loss reads every hidden state once; its scale keeps gradients O(1)
BODY_LOSS_SCALE = 1e-3


def liger_chunk_size(tokens: int, vocab: int, hidden: int) -> int:
    """Liger's chunk of tokens: ``next_power_of_2(ceil(BT / ceil(V / H)))``, so that a chunk's
    logits hold about as many elements as the hidden states.

    Example:
        >>> liger_chunk_size(2048, 50257, 128), liger_chunk_size(4 * 4096, 32000, 4096)
        (8, 2048)
    """
    inc = -(-vocab // hidden)
    per = -(-tokens // inc)
    return 1 << (per - 1).bit_length()


class FlceReference(torch.autograd.Function):
    """Liger's ``LigerFusedLinearCrossEntropyFunction`` in plain PyTorch (mean reduction): the
    gradients are made in the forward, chunk by chunk; the backward scales them."""

    @staticmethod
    def forward(ctx, h, weight, target, bias, ignore_index, label_smoothing, chunk):
        bt, _ = h.shape
        vocab = weight.shape[0]
        keep = target != ignore_index
        n = int(keep.sum())   # NOTE: Liger's total_n_non_ignore (a host sync there too)
        grad_h = torch.zeros_like(h)
        acc = torch.promote_types(h.dtype, torch.float32)  # NOTE: fp32 at least, as Liger's
        grad_w = torch.zeros_like(weight, dtype=acc)
        grad_b = None if bias is None else torch.zeros_like(bias, dtype=acc)
        loss = torch.zeros((), dtype=acc, device=h.device)
        eps = label_smoothing / vocab
        for s in range(0, bt, chunk):
            e = min(s + chunk, bt)
            h_c, y = h[s:e], target[s:e]
            logits = h_c @ weight.t()
            if bias is not None:
                logits += bias
            x = logits.to(acc)   # NOTE: Liger's kernel computes in fp32; a no-op for fp32
            ok = keep[s:e]
            y_safe = torch.where(ok, y, torch.zeros_like(y))
            x_y = x.gather(1, y_safe[:, None]).squeeze(1)
            lse = torch.logsumexp(x, dim=1)
            # loss = (1 - ls) (lse - x_y) + ls (lse - mean(x)), PyTorch's label smoothing
            tok = lse - (1 - label_smoothing) * x_y
            if label_smoothing:
                tok = tok - label_smoothing * x.mean(dim=1)
            loss += (tok * ok).sum() / n
            # NOTE: the gradient overwrites the logits, as Liger's kernel does:
            # (softmax - (1 - ls) onehot - ls / V) / n, zero on ignored rows
            g = x.sub_(lse[:, None]).exp_()
            if label_smoothing:
                g.sub_(eps)
            g.scatter_add_(1, y_safe[:, None],
                           torch.full_like(lse[:, None], -(1 - label_smoothing)))
            g.mul_((ok.to(g.dtype) / n)[:, None])
            g = g.to(h.dtype)
            torch.mm(g, weight, out=grad_h[s:e])
            grad_w.addmm_(g.t().to(grad_w.dtype), h_c.to(grad_w.dtype))  # NOTE: no copy in fp32
            if grad_b is not None:
                grad_b += g.sum(0).to(acc)
            del logits, x, g
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype),
                              None if grad_b is None else grad_b.to(bias.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        # NOTE: the loss is the last op: grad_out is 1 and Liger skips the multiply too
        if not bool(grad_out == 1):
            grad_h, grad_w = grad_h * grad_out, grad_w * grad_out
            grad_b = None if grad_b is None else grad_b * grad_out
        return grad_h, grad_w, None, grad_b, None, None, None


def flce_reference(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                   bias: torch.Tensor | None = None, *, ignore_index: int = IGNORE_INDEX,
                   label_smoothing: float = 0.0, chunk: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(h @ weight.T + bias, target, ignore_index=..., label_smoothing=...)``
    (mean over the tokens not ignored) without the full logits: Liger's chunked algorithm.
    ``h``: (tokens, hidden); ``chunk``: tokens per chunk (default: Liger's rule).

    Example:
        >>> h, w = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4)
        >>> y = torch.tensor([1, 2, -100, 3, 4, 5])
        >>> ref = F.cross_entropy(h @ w.t(), y, label_smoothing=0.1)
        >>> torch.allclose(flce_reference(h, w, y, label_smoothing=0.1, chunk=4), ref)
        True
    """
    chunk = chunk or liger_chunk_size(h.shape[0], weight.shape[0], h.shape[1])
    return FlceReference.apply(h, weight, target, bias, ignore_index, label_smoothing, chunk)


# -- the benchmark ------------------------------------------------------------------------------

@dataclass
class AnchorRow:
    system: str
    peak_bytes: int | None        # measured: resident + the meter's peak
    vocab_bytes: int | None       # peak over the body alone's peak
    step_s: float | None          # eager's median x the median paired ratio
    vs_eager: float | None        # median of step / the eager steps around it
    vs_reference: float | None    # median over rounds of (its ratio / its reference's): the
    #                               reference it was planned at, else Liger's-rule one
    spread: float | None          # (max - min) / median of its timed steps
    result: str = ""              # "bitwise" | "allclose" | "MISMATCH: ..." against eager
    notes: str = ""
    error: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def build(vocab: int, hidden: int, layers: int, seq: int, batch: int, heads: int = 2):
    """(model, batch): a GPT-2-style causal LM from a config (random weights, no dropout) and a
    batch whose labels end in padding (-100)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                     n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, vocab, (batch, seq))
    labels = ids.clone()
    labels[:, seq - max(1, seq // PAD_SHARE):] = IGNORE_INDEX
    return model, {"input_ids": ids, "labels": labels}


def reference_loss(model, batch, label_smoothing: float = 0.0, chunk: int | None = None):
    """The model to its last hidden state, then ``flce_reference`` on the tied LM head, labels
    shifted as Liger's Hugging Face integration shifts them (padded, every position kept)."""
    hidden = model.transformer(input_ids=batch["input_ids"]).last_hidden_state
    labels = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
    return flce_reference(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                          labels.reshape(-1), label_smoothing=label_smoothing, chunk=chunk)


def body_loss(model, batch):
    """The body alone: the model to its last hidden state, a loss with no vocabulary."""
    hidden = model.transformer(input_ids=batch["input_ids"]).last_hidden_state
    return hidden.mean() * BODY_LOSS_SCALE


def largest_block_bytes(model, batch) -> int:
    """Bytes each transformer block saves for the backward (each storage once), the largest."""
    saved: dict[int, dict[int, int]] = {}
    current = [None]

    def pack(t):
        if current[0] is not None and isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            saved[current[0]][st.data_ptr()] = st.nbytes()
        return t

    hooks = []
    for i, blk in enumerate(model.transformer.h):
        saved[i] = {}
        hooks.append(blk.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        hooks.append(blk.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.transformer(input_ids=batch["input_ids"])
    finally:
        for hk in hooks:
            hk.remove()
    return max(sum(d.values()) for d in saved.values())


def _copied(model, opt):
    m = copy.deepcopy(model)
    o = torch.optim.AdamW(m.parameters(), lr=LR)
    o.load_state_dict(copy.deepcopy(opt.state_dict()))
    return m, o


def _fitgraph_system(model, opt, batch, budget, time_budget):
    from ..api import optimize
    from .harness import _System

    step = optimize(model, batch, None, opt, budget=int(budget), time_budget=time_budget)
    return _System("fitgraph", None, model, opt, lambda: step(batch)), step


def _fitgraph_notes(step) -> str:
    """auto's winner, the splits, the simulated peak and what fills it (``sim.breakdown``)."""
    from ..units import format_bytes

    sol = step._current().solution
    parts = [f"winner {sol.notes.get('winner', sol.solver)}"]
    splits = [str(x) for x in sol.notes.get("splits") or []]
    if splits:
        more = f" (+{len(splits) - 1} more)" if len(splits) > 1 else ""
        parts.append(f"split {splits[0]}{more}")
    top = ", ".join(f"{k} {format_bytes(v)}" for k, v in sol.sim.breakdown.items())
    parts.append(f"sim peak {format_bytes(sol.sim.peak_bytes)} ({top})")
    return "; ".join(parts)


def run(vocab: int = 50257, hidden: int = 128, layers: int = 2, seq: int = 512, batch: int = 4,
        rounds: int = 7, time_budget: float = 30.0, smallest: bool = True,
        chunks: tuple[int, ...] = (), progress=print) -> tuple[list[AnchorRow], dict]:
    """Measure the systems on one GPT-2-style model; (rows, facts about the run). ``chunks``:
    the reference again at these chunk sizes (tokens), beside Liger's rule."""
    from ..api import optimize
    from ..measure import resident_bytes
    from ..solvers import BudgetInfeasible
    from .harness import _measure_memory, _System, _time_rounds, error_text
    from .sweep_measure import compare

    torch.set_num_threads(1)
    model, data = build(vocab, hidden, layers, seq, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    # NOTE: one eager step first: AdamW's state exists and every system plans the steady step
    model(**data).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    chunk = liger_chunk_size(batch * seq, vocab, hidden)
    facts = {"tokens": batch * seq, "chunk": chunk, "block_bytes": largest_block_bytes(model, data)}

    def eager_step(m, o, loss_fn):
        def step():
            loss = loss_fn(m, data)
            loss.backward()
            o.step()
            return loss
        return step

    def plain(m, b):
        return m(**b).loss

    systems: list[_System] = []
    results: dict[str, str] = {}
    errors: dict[str, str] = {}
    notes: dict[str, str] = {}
    matched: dict[str, _System] = {}   # fitgraph's row -> the reference whose peak it was given

    def first_step(s: _System):
        """The system's first step against eager's from the same weights and state."""
        twin_m, twin_o = _copied(model, opt)
        loss_e = plain(twin_m, data)
        loss_e.backward()
        twin_o.step()
        loss_s = s.step()
        verdict, detail = compare(loss_e, loss_s, twin_m, s.model)
        results[s.name] = verdict + (f": {detail}" if verdict == "MISMATCH" else "")

    def add(name, make):
        m, o = _copied(model, opt)
        t0 = time.perf_counter()
        try:
            s, extra = make(m, o)
            s.name = name
            first_step(s)
            s.prepare_s = time.perf_counter() - t0
            if extra is not None:
                notes[name] = _fitgraph_notes(extra)
            systems.append(s)
            progress(f"  {name}: ready in {s.prepare_s:.1f} s ({results[name]})")
            return s
        except Exception as e:  # NOTE: a failing system is a row with its error
            errors[name] = error_text(e)
            progress(f"  {name}: error: {errors[name]}")
            return None

    eager = add("eager", lambda m, o: (_System("", None, m, o, eager_step(m, o, plain)), None))
    ref = add("reference", lambda m, o: (_System("", None, m, o, eager_step(
        m, o, reference_loss)), None))
    refs = [ref] + [add(f"reference, chunk {c}", lambda m, o, c=c: (_System(
        "", None, m, o, eager_step(m, o, functools.partial(reference_loss, chunk=c))), None))
        for c in chunks]
    body_m, body_o = _copied(model, opt)
    body = _System("body", None, body_m, body_o, eager_step(body_m, body_o, body_loss))
    body.step()
    _measure_memory([s for s in systems if s is not None] + [body], data)
    facts["body_peak"] = body.peak
    for r in refs:
        if r is not None:   # NOTE: at each reference's measured peak, in bytes
            add(f"fitgraph @ {r.name}", lambda m, o, r=r: _fitgraph_system(
                m, o, data, r.peak, time_budget))
            matched[f"fitgraph @ {r.name}"] = r
    if smallest:
        m, o = _copied(model, opt)
        try:
            optimize(m, data, None, o, budget=resident_bytes(m, data, o) // 2,
                     time_budget=time_budget)
            errors["fitgraph smallest"] = "an impossible budget was met"
        except BudgetInfeasible as e:
            facts["smallest_sim"] = e.smallest_peak_bytes
            facts["smallest_dominated_by"] = e.dominated_by
            smallest_peak = e.smallest_peak_bytes
            add("fitgraph smallest", lambda m, o: _fitgraph_system(m, o, data, smallest_peak,
                                                                   time_budget))
        except Exception as e:
            errors["fitgraph smallest"] = error_text(e)
    fits = [s for s in systems if s.name.startswith("fitgraph")]
    _measure_memory(fits, data)
    progress(f"  memory measured; timing {len(systems)} systems in {rounds} paired rounds")
    if eager is not None:
        _time_rounds(systems, rounds, reference=eager)
    eager_s = statistics.median(eager.times) if eager is not None and eager.times else None

    def row(s: _System) -> AnchorRow:
        vs_e = statistics.median(s.ratios) if s is not eager and s.ratios else (
            1.0 if s is eager else None)
        vs_r, r = None, matched.get(s.name, ref)
        if r is not None and s is not eager and s.ratios and r.ratios:
            vs_r = 1.0 if s is r else statistics.median(
                a / b for a, b in zip(s.ratios, r.ratios))
        step_s = None if vs_e is None or eager_s is None else vs_e * eager_s
        spread = ((max(s.times) - min(s.times)) / statistics.median(s.times)
                  if s.times else None)
        return AnchorRow(s.name, s.peak, None if s.peak is None or body.peak is None
                         else s.peak - body.peak, step_s, vs_e, vs_r, spread,
                         results.get(s.name, ""), notes.get(s.name, ""))

    rows = [row(s) for s in systems]
    rows += [AnchorRow(name, None, None, None, None, None, None, error=err)
             for name, err in errors.items()]
    return rows, facts


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _x(v, fmt="{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: list[AnchorRow], facts: dict) -> str:
    """The markdown table of ``run``'s rows."""
    eager = next((r for r in rows if r.system == "eager" and r.peak_bytes), None)
    lines = ["| system | peak (MiB) | peak / eager | vocab region (MiB) | step (s) "
             "| time / eager | time / reference (its own) | spread | result vs eager | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.system} | - | - | - | - | - | - | - | error | {r.error} |")
            continue
        frac = None if eager is None or r.peak_bytes is None else r.peak_bytes / eager.peak_bytes
        lines.append(f"| {r.system} | {_mib(r.peak_bytes)} | {_x(frac)} | {_mib(r.vocab_bytes)} "
                     f"| {_x(r.step_s)} | {_x(r.vs_eager)} | {_x(r.vs_reference)} "
                     f"| {_x(r.spread, '{:.0%}')} | {r.result} | {r.notes} |")
    lines.append("")
    lines.append(f"Body alone (model to its last hidden state): {_mib(facts.get('body_peak'))} MiB"
                 f"; largest block saves {_mib(facts.get('block_bytes'))} MiB (target: vocab "
                 f"region <= {_mib(2 * facts['block_bytes'])} MiB); reference chunk "
                 f"{facts['chunk']} of {facts['tokens']} tokens"
                 + (f"; smallest fitgraph peak (simulated) {_mib(facts['smallest_sim'])} MiB, "
                    f"dominated by {facts['smallest_dominated_by']}"
                    if "smallest_sim" in facts else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..execute.host_memory import keep_host_memory

    keep_host_memory()  # NOTE: timed with warm host memory (execute/host_memory.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--time-budget", type=float, default=30.0)
    ap.add_argument("--chunks", default="",
                    help="the reference again at these chunk sizes (tokens, comma-separated)")
    ap.add_argument("--no-smallest", action="store_true")
    args = ap.parse_args(argv)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{platform.processor() or platform.machine()}, 1 thread; GPT2LMHeadModel vocab "
          f"{args.vocab}, hidden {args.hidden}, {args.layers} layers, batch {args.batch} x seq "
          f"{args.seq}; {args.rounds} paired rounds\n", flush=True)
    rows, facts = run(args.vocab, args.hidden, args.layers, args.seq, args.batch, args.rounds,
                      args.time_budget, not args.no_smallest,
                      tuple(int(c) for c in args.chunks.split(",") if c))
    print(table(rows, facts))
    return 0 if all(not r.error and not r.result.startswith("MISMATCH") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

