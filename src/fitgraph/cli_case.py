"""The model and optimizer a ``fitgraph`` command runs on: a zoo case built from its
arguments (``--model``, ``--config``, ``--batch``, ``--optimizer``, ``--threads``).

Example:
    >>> make_optimizer("none", None) is None
    True
"""

from __future__ import annotations

__all__ = ["OPTIMIZERS", "build_case", "make_optimizer"]

# NOTE: ``--optimizer``'s choices: torch's per-parameter optimizers fitgraph captures
# (``capture.optimizer_kinds``), by class name in lower case
OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop", "adagrad", "adamax", "nadam", "radam",
              "adadelta", "asgd", "rprop", "adafactor", "muon", "none")


def make_optimizer(kind: str, model):
    """The optimizer ``--optimizer KIND`` names for ``model`` (None for "none"): SGD with
    momentum at lr 1e-3, Adadelta with torch's defaults (its lr scales a unit-free step), the
    others at lr 1e-4; "muon": Muon (lr 0.02) for the weights of the model's ``nn.Linear``
    layers (an embedding's weight tied to one excluded) and AdamW (lr 1e-4) for the rest,
    stepped as one (``capture.combined_optimizer``).

    NOTE: torch's default lr of RMSprop (1e-2) diverges a zoo GPT-2 within steps: its
    activations turn subnormal and the measured step runs 2.6x what ops on sane values take
    (1.07 s against 0.41 s simulated), eager PyTorch's alike."""
    import torch

    if kind == "none":
        return None
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if kind in ("adamw", "adam"):
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        return cls(model.parameters(), lr=1e-4)
    if kind == "adadelta":
        return torch.optim.Adadelta(model.parameters())
    if kind == "muon":
        return _muon_and_adamw(model)
    from .capture.optimizer_kinds import KINDS

    classes = {c.__name__.lower(): c for k in KINDS.values() for c in k.classes}
    return classes[kind](model.parameters(), lr=1e-4)


def build_case(args):
    """The zoo case and optimizer a command asks for (paper configs on the meta device)."""
    import torch

    from . import zoo

    torch.set_num_threads(args.threads)
    case = zoo.build(args.model, args.config, batch_size=args.batch,
                     device="meta" if args.config == "paper" else "cpu")
    return case, make_optimizer(args.optimizer, case.model)


def _muon_and_adamw(model):
    """Muon over the ``nn.Linear`` weights (Muon's own advice: the hidden matrices), AdamW over
    every other parameter (biases, norms, embeddings, a head tied to an embedding)."""
    import torch

    from .capture.combined_optimizer import CombinedOptimizer

    if not hasattr(torch.optim, "Muon"):
        raise ValueError(f"--optimizer muon needs torch >= 2.9 (this is {torch.__version__})")
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matrices = {id(m.weight): m.weight for m in model.modules()
                if isinstance(m, torch.nn.Linear) and m.weight.ndim == 2
                and id(m.weight) not in embedded}
    rest = [p for p in model.parameters() if id(p) not in matrices]
    opts = [torch.optim.Muon(list(matrices.values()), lr=0.02)] if matrices else []
    return CombinedOptimizer(opts + ([torch.optim.AdamW(rest, lr=1e-4)] if rest else []))
