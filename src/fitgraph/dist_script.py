"""A runnable ``torchrun`` script for a zoo model's multi-device plan
(``fitgraph plan-dist MODEL ... --emit-script FILE``): it builds the model, hands it to
``fitgraph.dist.parallelize`` with the saved plan, trains a few steps and prints each rank's
measured step and peak beside the plan's (``step.report()``).

Example:
    >>> text = script_text("gpt2", "small", "float32", 8, 64, "plan.json", 4)
    >>> "parallelize(" in text and "torchrun --nproc-per-node 4" in text
    True
"""

from __future__ import annotations

__all__ = ["script_text"]

TEMPLATE = '''"""Train {model} ({config}, {dtype}) with fitgraph's multi-device plan {plan!r}.

Written by `fitgraph plan-dist {model} ... --emit-script`. Run it with

    torchrun --nproc-per-node {devices} {{this file}} [--steps N]

Every rank builds the model, keeps its part of the plan (pipeline stages, tensor and data
parallel shards) and trains on the same global batch; rank 0 prints the loss and, at the end,
each rank's measured step time and peak memory beside the plan's prediction.
"""

import argparse
import os

import torch

import fitgraph.zoo as zoo
from fitgraph.cli_case import make_optimizer
from fitgraph.dist import parallelize

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--save", default=None, help="write a checkpoint (DCP) at the end")
    args = ap.parse_args()
    torch.manual_seed(0)
    case = zoo.build({model!r}, {config!r}, batch_size={batch}, seq_len={seq},
                     dtype=torch.{dtype})
    optimizer = make_optimizer({optimizer!r}, case.model)
    step = parallelize(case.model, case.batch, case.loss_fn, optimizer,
                       plan=os.path.join(HERE, {plan!r}), measure_memory=True)
    rank = torch.distributed.get_rank()
    for i in range(args.steps):
        loss = step(case.batch)
        if rank == 0:
            print(f"step {{i}}: loss {{loss.item():.4f}}", flush=True)
    report = step.report()
    if rank == 0:
        print(report)
    if args.save:
        step.save(args.save)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def script_text(model: str, config: str, dtype: str, batch: int, seq: int, plan_file: str,
                devices: int, optimizer: str = "adamw") -> str:
    """The script for zoo ``model`` trained on global batches of ``batch`` × ``seq`` with
    the plan saved at ``plan_file`` (relative to the script), by ``optimizer`` (a
    ``--optimizer`` name: ``cli_case.make_optimizer``)."""
    return TEMPLATE.format(model=model, config=config, dtype=dtype, batch=batch, seq=seq,
                           plan=plan_file, devices=devices, optimizer=optimizer)
