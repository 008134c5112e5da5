"""The model's parameters and buffers by name, a step at a time, without walking the model.

``dict(model.named_parameters())`` walks every module: ~0.3 ms on a ResNet, a percent of a
small model's step, and a step needs the parameters and buffers by name (the graph's inputs,
``.grad`` write-back, optimizer state). ``ModelSlots`` finds once where each one lives (its
module and attribute) and reads them from those modules' dictionaries each step. Replacing a
parameter or buffer (``module.weight = nn.Parameter(...)``, ``.to()`` making new buffers) is
seen, since the dictionaries are read each time; replacing a submodule is seen by checking
that every module is still its parent's child (dictionary lookups), and then the model is
walked again.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    >>> slots = ModelSlots(model)
    >>> params, buffers = slots.tensors()
    >>> params["0.weight"] is model[0].weight and "1.running_mean" in buffers
    True
    >>> model[0] = torch.nn.Linear(2, 2)              # a replaced submodule: found again
    >>> slots.tensors()[0]["0.weight"] is model[0].weight
    True
"""

from __future__ import annotations

import torch

__all__ = ["ModelSlots"]


class ModelSlots:
    """``tensors() -> (params, buffers)``: what ``named_parameters()`` / ``named_buffers()``
    give, as dicts, read from where they were found (see the module doc)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._edges: list[tuple[torch.nn.Module, str, torch.nn.Module | None]] | None = None
        self._params: list[tuple[str, torch.nn.Module, str]] = []
        self._buffers: list[tuple[str, torch.nn.Module, str]] = []

    def _find(self) -> None:
        m = self.model
        self._edges = [(mod, key, child) for _, mod in m.named_modules()
                       for key, child in mod._modules.items()]

        def owner(name: str) -> tuple[torch.nn.Module, str]:
            path, _, attr = name.rpartition(".")
            return (m.get_submodule(path) if path else m), attr

        self._params = [(n, *owner(n)) for n, _ in m.named_parameters()]
        self._buffers = [(n, *owner(n)) for n, _ in m.named_buffers()]

    def _moved(self) -> bool:
        return self._edges is None or any(mod._modules.get(key) is not child
                                          for mod, key, child in self._edges)

    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if self._moved():
            self._find()
        try:
            params = {n: mod._parameters[a] for n, mod, a in self._params}
            buffers = {n: mod._buffers[a] for n, mod, a in self._buffers}
        except KeyError:   # NOTE: a parameter or buffer deleted or turned into the other
            self._find()
            return (dict(self.model.named_parameters()), dict(self.model.named_buffers()))
        if any(v is None for v in params.values()) or any(v is None for v in buffers.values()):
            return (dict(self.model.named_parameters()), dict(self.model.named_buffers()))
        return params, buffers
