"""fitgraph model zoo: whole training steps to capture, plan and benchmark.

Every case is a model, one batch and a loss, in a "small" config (runs one
fp32 step on a laptop CPU in about a second, with the paper config's
proportions, so activations dominate memory) and a "paper" config (the sizes
from the literature; build it with ``device="meta"`` to avoid allocating)::

    from fitgraph import zoo
    case = zoo.build("gpt2", "small")
    loss = case.loss_fn(case.model, case.batch)

Built-in models are plain PyTorch (``zoo.names()``); ``zoo.hf_names()`` are
Hugging Face ``transformers`` models, built only when asked for.

Example:
    >>> from fitgraph import zoo
    >>> case = zoo.build("gpt2-xl", "paper", device="meta")
    >>> sum(p.numel() for p in case.model.parameters()) // 10**6
    1557
    >>> tuple(case.batch["input_ids"].shape), case.batch["input_ids"].device.type
    ((8, 1024), 'meta')
"""

from __future__ import annotations

# NOTE: importing the model modules registers their names; hf.py imports
# transformers lazily, inside its builders, so this costs nothing without it.
from . import bert, gpt2, hf, llama, resnet, unet, vit  # noqa: F401
from .registry import BuildArgs, ZooCase, build, configs, hf_names, names, register

__all__ = ["BuildArgs", "ZooCase", "build", "configs", "hf_names", "names", "register"]
