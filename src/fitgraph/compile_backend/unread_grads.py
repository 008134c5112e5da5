"""Gradients no one can read: of tensors a step makes for itself and lets go.

Hugging Face's speech models (wav2vec2, HuBERT, WavLM, Data2VecAudio, SEW) start their
feature encoder with ``hidden_states = input_values[:, None]; hidden_states.requires_grad =
True`` (so that gradient checkpointing sees an input that requires grad). Under torch.compile
the setattr is a graph break, and the region after it takes that tensor as a leaf input that
requires grad: its backward makes the leaf's gradient, accumulated into a ``.grad`` that no
one can read, since the step holds the leaf nowhere once its backward ran. fitgraph's whole
-step capture makes the parameters' gradients alone and never makes it; by regions, that
gradient made the first convolution's backward read its input gradient whole (a [batch, 512,
T/5] tensor in wav2vec2, the step's peak), where without it the backward runs in parts.

A leaf that requires grad and is not a parameter may be one the user holds (the batch of an
adversarial step, a tensor an optimizer updates): whether anyone can read its gradient is
measured, not guessed. ``LeafRuns`` keeps a weak reference to each such input of each planned
forward while a step is measured; those dead once the step ended (loss, backward, optimizer
step) could not be read, and a region planned again leaves their gradients out
(``drop_grads``): the backward returns None for them, as autograd allows, and their ``.grad``
stays None, on tensors no one holds. A leaf with gradient hooks at its forward counts as
read (its hooks see the gradient).

Example:
    >>> import torch
    >>> runs = LeafRuns()
    >>> kept, made = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    >>> runs.note("g", [kept, made, torch.nn.Parameter(torch.ones(1))])
    >>> del made
    >>> runs.unread()
    {'g': {1}}
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["LeafRuns", "drop_grads", "leaf_inputs"]


def leaf_inputs(args) -> list[int]:
    """Indices of ``args`` that are leaf tensors requiring grad and not parameters."""
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)
            and not isinstance(a, torch.nn.Parameter) and a.is_leaf and a.requires_grad]


class LeafRuns:
    """Weak references to the leaf inputs (``leaf_inputs``) of each graph's forward runs."""

    def __init__(self) -> None:
        self._refs: dict[tuple[str, int], list] = {}

    def note(self, key: str, args) -> None:
        """Graph ``key``'s forward ran on ``args``. A leaf with gradient hooks counts as read
        (its hooks see the gradient): it is held strongly, never found dead."""
        for i in leaf_inputs(args):
            a = args[i]
            hooked = a._backward_hooks or getattr(a, "_post_accumulate_grad_hooks", None)
            self._refs.setdefault((key, i), []).append((lambda t=a: t) if hooked
                                                       else weakref.ref(a))

    def unread(self) -> dict[str, set[int]]:
        """Graph key -> input indices whose every run's tensor is gone: their gradients were
        accumulated where no one could read them."""
        out: dict[str, set[int]] = {}
        for (key, i), refs in self._refs.items():
            if all(r() is None for r in refs):
                out.setdefault(key, set()).add(i)
        return out


def drop_grads(joint: torch.fx.GraphModule, num_fwd_outputs: int, inputs: set[int]) -> list[str]:
    """Make AOTAutograd's ``joint`` graph return None as the gradients of primal ``inputs``,
    and drop what only they read. Returns the names of the inputs whose gradients went."""
    if not inputs:
        return []
    out = joint.graph.output_node()
    flat = list(out.args[0])
    primals = list(joint.graph.find_nodes(op="placeholder"))
    dropped = []
    for i in sorted(inputs):
        at = num_fwd_outputs + i
        if at < len(flat) and flat[at] is not None:
            flat[at] = None
            dropped.append(primals[i].name)
    if dropped:
        out.args = (type(out.args[0])(flat),) + tuple(out.args[1:])
        joint.graph.eliminate_dead_code()
        _unmask_unused(joint.graph)
        joint.recompile()
    return dropped


def _unmask_unused(graph: torch.fx.Graph) -> None:
    """Backwards that make several gradients by an ``output_mask`` (convolution, the norms)
    no longer make those no getitem reads: dead-code elimination drops the getitem, not the
    work (the first convolution's backward still made the audio's gradient, reading its whole
    output gradient)."""
    import operator

    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        at = next((i for i, a in enumerate(schema.arguments) if a.name == "output_mask"), None)
        if at is None or at >= len(node.args) or "output_mask" in node.kwargs:
            continue
        read = {u.args[1] for u in node.users if u.target is operator.getitem}
        if len(read) != len(node.users):
            continue   # NOTE: the tuple is read whole somewhere: every output stays
        mask = list(node.args[at])
        kept = [bool(m) and i in read for i, m in enumerate(mask)]
        if kept == mask or not any(kept):
            continue
        node.args = node.args[:at] + (kept,) + node.args[at + 1:]
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            node.meta["val"] = type(val)(v if k else None for v, k in zip(val, kept))
