"""The model and optimizer a ``fitgraph`` command runs on: a zoo case built from its
arguments (``--model``, ``--config``, ``--batch``, ``--optimizer``, ``--threads``).

Example:
    >>> make_optimizer("none", None) is None
    True
"""

from __future__ import annotations

__all__ = ["build_case", "make_optimizer"]


def make_optimizer(kind: str, model):
    """The optimizer ``--optimizer KIND`` names for ``model`` (None for "none")."""
    import torch

    if kind == "none":
        return None
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls(model.parameters(), lr=1e-4)


def build_case(args):
    """The zoo case and optimizer a command asks for (paper configs on the meta device)."""
    import torch

    from . import zoo

    torch.set_num_threads(args.threads)
    case = zoo.build(args.model, args.config, batch_size=args.batch,
                     device="meta" if args.config == "paper" else "cpu")
    return case, make_optimizer(args.optimizer, case.model)
