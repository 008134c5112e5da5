"""Op latency and workspace: measured on this machine, or a roofline on a device datasheet.

Two ``CostModel`` implementations answer the simulator's questions (how long does a node take,
how many transient bytes does it allocate, how long does a host copy take):

* ``ProfiledCostModel`` runs every distinct node on this machine's CPU or GPU and caches the
  measurements in SQLite (imports torch; loaded lazily).
* ``RooflineCostModel`` computes them from a ``DeviceSpec`` (no torch): plan for an H100 from a
  laptop.

Example:
    >>> from fitgraph.cost import cost_model_for, get_device
    >>> cost_model_for("h100").name
    'h100 (roofline)'
    >>> get_device("rtx3090").memory_bytes // 2**30
    24
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import BaseCostModel, CostModel, NodeCost, check_cost_model
from .cache import CostCache
from .devices import DEVICES, DeviceSpec, get_device
from .roofline import RooflineCostModel

if TYPE_CHECKING:
    from .profiler import ProfiledCostModel

__all__ = [
    "DEVICES",
    "BaseCostModel",
    "CostCache",
    "CostModel",
    "DeviceSpec",
    "NodeCost",
    "ProfiledCostModel",
    "RooflineCostModel",
    "check_cost_model",
    "choose_cost_model",
    "cost_model_for",
    "get_device",
    "measures_here",
]


def __getattr__(name: str):
    # NOTE: the profiler imports torch; load it only when asked, so that planning with a
    # roofline model stays torch-free
    if name == "ProfiledCostModel":
        from .profiler import ProfiledCostModel

        return ProfiledCostModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def measures_here(cost_model) -> bool:
    """Whether ``cost_model`` measures ops on a device of this machine (not a model of
    hardware we lack): a plan made with it can be timed here against eager."""
    from .profiler import ProfiledCostModel  # NOTE: imports torch: only where asked

    return isinstance(cost_model, ProfiledCostModel)


def choose_cost_model(spec, device: str = "cpu") -> CostModel:
    """The cost model a user's ``cost_model=`` argument names, for a model on ``device``: the
    one choice ``optimize`` and ``fitgraph.backend`` both make.

    * None or ``"measured"``: ops measured on ``device`` (``ProfiledCostModel``, cached);
      ``"measured:cuda:1"`` names another device;
    * a device name (``"h100"``) or a ``DeviceSpec``: ``RooflineCostModel`` on it;
    * a cost model object (anything with ``node_cost``): itself.

    Example:
        >>> from fitgraph.cost import choose_cost_model, get_device
        >>> choose_cost_model("h100").name, choose_cost_model(get_device("a100-80gb")).name
        ('h100 (roofline)', 'a100-80gb (roofline)')
        >>> choose_cost_model(3)
        Traceback (most recent call last):
        ...
        TypeError: cost_model=3: pass None or 'measured' (ops timed on this machine), a device name or DeviceSpec (a roofline), or a cost model object
    """
    if spec is None or isinstance(spec, str) and spec.strip().lower() == "measured":
        from .profiler import ProfiledCostModel  # NOTE: imports torch: only where asked

        return ProfiledCostModel(str(device), progress=False)
    if isinstance(spec, str):
        return cost_model_for(spec, progress=False)
    if isinstance(spec, DeviceSpec):
        return RooflineCostModel(spec)
    if callable(getattr(spec, "node_cost", None)):
        check_cost_model(spec)
        return spec
    raise TypeError(f"cost_model={spec!r}: pass None or 'measured' (ops timed on this "
                    "machine), a device name or DeviceSpec (a roofline), or a cost model "
                    "object")


def cost_model_for(spec: str, progress: bool = True) -> CostModel:
    """A cost model from a short spec.

    * ``"measured"``: ``ProfiledCostModel`` on the current CUDA device if there is one, else
      the CPU; ``"measured:cpu"`` / ``"measured:cuda:1"`` pick the device.
    * a registered device name (``"a100-80gb"``, ``"h100"``, ``"cpu-generic"``, ...):
      ``RooflineCostModel`` on it.
    """
    s = spec.strip()
    kind, _, device = s.partition(":")
    if kind.lower() == "measured":
        from .profiler import ProfiledCostModel

        if not device:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return ProfiledCostModel(device, progress=progress)
    if s.lower() not in DEVICES:
        raise ValueError(f"unknown cost model {spec!r}: use 'measured' (this machine) or a "
                         f"device name: {', '.join(sorted(DEVICES))}")
    return RooflineCostModel(get_device(s))
