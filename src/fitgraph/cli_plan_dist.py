"""``fitgraph plan-dist MODEL --devices N``: the best multi-device plan of a training step, or
(``--fix``) the prediction of a given configuration; text, ``--json``, ``--plot`` (Gantt PNG),
``--save`` (the plan as JSON for the executor).

Example:
    >>> args = build_parser().parse_args(["gpt", "--layers", "24", "--hidden", "2304",
    ...                                   "--heads", "24", "--devices", "8",
    ...                                   "--global-batch", "64"])
    >>> args.devices, args.gpus_per_node, args.device
    (8, 8, 'a100-80gb')
"""

from __future__ import annotations

import argparse
import json

from . import progress
from .cli_case import OPTIMIZERS

__all__ = ["add_parser", "build_parser", "captured_model", "cmd_plan_dist", "format_plan",
           "gpt_shape", "model_arguments", "require_model"]

GIB = 2**30


def model_arguments(p: argparse.ArgumentParser, model_help: str, dtype_default: str) -> None:
    """The model options ``plan-dist`` and ``hw-search`` share (see ``gpt_shape``,
    ``captured_model``)."""
    # NOTE: the model is positional or ``--model`` (the spelling of the issues and of Phaze's
    # scripts); SUPPRESS keeps an absent positional from overwriting ``--model``.
    what = ("'gpt' (with --layers/--hidden/--heads), a GPT preset (gpt3-175b, llama2-7b, "
            "bert-large, gpt2-xl, gpt-1.7b ... gpt-1t: Megatron-LM's Table 1 models), or a zoo "
            f"model (`fitgraph models`: its step captured, {model_help})")
    p.add_argument("model", nargs="?", default=argparse.SUPPRESS, help=what)
    p.add_argument("--model", dest="model", default=argparse.SUPPRESS, metavar="MODEL",
                   help="the model, as an option (the same as the positional)")
    p.add_argument("--config", default="small", choices=["small", "paper"],
                   help="zoo model size (paper: built on the meta device)")
    p.add_argument("--batch", type=int, default=None,
                   help="zoo model: the batch to capture at (micro-batches scale from it)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help=f"zoo model: the dtype to capture in (default {dtype_default}); "
                        f"float32 plans with --precision fp32-adam")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary (default: the preset's; 51,200 for 'gpt')")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (default: the preset's; 2048 for 'gpt')")


def require_model(args, command: str) -> str:
    """The model named positionally or by ``--model``; a clear exit where neither is."""
    if getattr(args, "model", None) is None:
        raise SystemExit(f"{command}: name a model (positional or --model): 'gpt' with "
                         "--layers/--hidden/--heads, a GPT preset, or a zoo model")
    return args.model


def _arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p, "planned with tp=1", "bfloat16, float32 on cpu-generic")
    p.add_argument("--devices", type=int, required=True, help="devices in all")
    p.add_argument("--device", default="a100-80gb",
                   help="device kind: a100-80gb, a100-40gb, h100, rtx3090, cpu-generic")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-gbps", type=float, default=None,
                   help="link inside a node, GB/s per device one way (default NVLink 3: 300)")
    p.add_argument("--inter-gbps", type=float, default=None,
                   help="link between nodes, GB/s per device one way (default HDR IB: 25)")
    p.add_argument("--intra-latency-us", type=float, default=None)
    p.add_argument("--inter-latency-us", type=float, default=None)
    p.add_argument("--global-batch", type=int, required=True, help="samples per step")
    p.add_argument("--precision", default=None,
                   choices=["mixed-adam", "fp32-adam", "mixed-sgd"],
                   help="bytes per parameter: mixed-adam is 16 (bf16 weights and grads, fp32 "
                        "master and Adam moments; the default), fp32-adam 16 (float32 weights)")
    p.add_argument("--optimizer", default=None, choices=[o for o in OPTIMIZERS if o != "none"],
                   help="a zoo model trained by this optimizer: its state priced as it keeps it "
                        "(muon: Muon for the linear weights, AdamW for the rest; whole "
                        "matrices, so no tensor parallelism and ZeRO at most 1); the emitted "
                        "script builds it (default: --precision's Adam)")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="memory per device for the plan (default: the device's less 2 GiB)")
    p.add_argument("--fix", default="", help="pin fields: tp=8,pp=8,dp=16,microbatch=1,"
                   "schedule=1f1b[,chunks=2,zero=1,sp=1,recompute=full|selective|none|auto,"
                   "overlap=0]; tp, pp, dp, microbatch and schedule together predict that "
                   "configuration")
    p.add_argument("--datasheet", action="store_true",
                   help="plan on datasheet peaks, without the device's calibration")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE", help="write the schedule's Gantt chart (PNG)")
    p.add_argument("--save", metavar="FILE", help="write the plan (JSON) for the executor")
    p.add_argument("--emit-script", metavar="FILE",
                   help="zoo model: write a torchrun script that runs the plan (and the plan "
                        "beside it, FILE with .plan.json)")


def add_parser(sub) -> None:
    p = sub.add_parser("plan-dist", help="plan pipeline, tensor and data parallelism with "
                       "per-stage memory plans over many devices; predicted time and memory")
    _arguments(p)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fitgraph plan-dist")
    _arguments(p)
    return p


def _model(args, cluster):
    """A GPT by its shape, or a zoo model's captured step (timed on the cluster's device)."""
    from .cost import RooflineCostModel
    from .dist.megatron_table import GPT_PRESETS

    if args.model == "gpt" or args.model in GPT_PRESETS:
        if getattr(args, "optimizer", None):
            raise SystemExit("plan-dist --optimizer prices a zoo model's parameters; a model "
                             "by its shape takes --precision")
        return gpt_shape(args)
    cpu = cluster.device.name.startswith("cpu")
    return captured_model(args, RooflineCostModel(cluster.device),
                          "float32" if cpu else "bfloat16", "plan-dist")


def captured_model(args, cost_model, default_dtype: str, command: str):
    """A zoo model's captured step as the planner's ``GraphModel`` timed by ``cost_model``
    (``args``: model, config, batch, dtype; sets ``args.precision`` where unset)."""
    import torch

    from . import zoo
    from .capture.api import capture
    from .dist.graph_model import GraphModel
    from .dist.megatron_table import GPT_PRESETS

    dtype = args.dtype or default_dtype
    try:
        case = zoo.build(args.model, args.config, batch_size=args.batch,
                         device="meta" if args.config == "paper" else "cpu",
                         dtype=getattr(torch, dtype))
    except (KeyError, ValueError) as e:
        raise SystemExit(f"{command}: {e}; or 'gpt' with --layers/--hidden/--heads, or one of "
                         f"{', '.join(GPT_PRESETS)}") from None
    graph = capture(case.model, case.batch, case.loss_fn, None)
    batch, seq = _batch_shape(case.batch)
    if getattr(args, "optimizer", None):
        from .cli_case import make_optimizer
        from .dist.runtime.precision import precision_of

        # NOTE: the state the optimizer keeps for this model's parameters, as it runs
        args.precision = precision_of(case.model, make_optimizer(args.optimizer, case.model))
    if args.precision is None:
        args.precision = "fp32-adam" if dtype == "float32" else "mixed-adam"
    # NOTE: a plan for --emit-script is one the runtime runs: no loss in parts
    return GraphModel(graph, cost_model, batch_size=batch,
                      name=f"{args.model} ({args.config}, {dtype})", seq=seq,
                      loss_in_parts=not getattr(args, "emit_script", None))


def _batch_shape(batch) -> tuple[int, int]:
    """Samples in a batch (the first tensor's first dim) and tokens per sample (its second,
    where it holds token ids; else 1)."""
    import torch

    stack = [batch]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            seq = x.shape[1] if x.dim() == 2 and not x.is_floating_point() else 1
            return int(x.shape[0]), int(seq)
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    raise SystemExit("plan-dist: the zoo model's batch holds no tensor")


def gpt_shape(args):
    """The GPT shape of `model` (`gpt` with --layers/--hidden/--heads, or a preset)."""
    from .dist.megatron_table import GPT_PRESETS, GptShape

    if args.model == "gpt":
        missing = [f"--{n}" for n in ("layers", "hidden", "heads") if getattr(args, n) is None]
        if missing:
            raise SystemExit(f"plan-dist gpt needs {', '.join(missing)}")
        return GptShape(args.layers, args.hidden, args.heads, args.vocab or 51200,
                        args.seq or 2048)
    if args.model in GPT_PRESETS:
        s = GPT_PRESETS[args.model]
        return GptShape(s.layers, s.hidden, s.heads, args.vocab or s.vocab, args.seq or s.seq)
    raise SystemExit(f"plan-dist: unknown model {args.model!r}: 'gpt' with --layers/--hidden/"
                     f"--heads, one of {', '.join(GPT_PRESETS)}, or a zoo model")


def _cluster(args):
    from .dist.calibration import calibrated_device
    from .dist.cluster import LINKS, Cluster, Link

    if args.devices % args.gpus_per_node and args.devices > args.gpus_per_node:
        raise SystemExit(f"--devices {args.devices} is not a whole number of nodes of "
                         f"{args.gpus_per_node}")
    per_node = min(args.gpus_per_node, args.devices)
    if args.datasheet:
        from .cost.devices import get_device
        device, note = get_device(args.device), "datasheet peaks"
    else:
        device, note = calibrated_device(args.device)

    def link(base: Link, gbps, lat_us) -> Link:
        if gbps is None and lat_us is None:
            return base
        return Link(base.name + "*", base.bandwidth if gbps is None else gbps * 1e9,
                    base.latency_s if lat_us is None else lat_us * 1e-6, "given on the command line")

    # NOTE: CPU devices are processes joined by gloo (measured once: bench.gloo_link)
    cpu = device.name.startswith("cpu")
    intra = link(LINKS["gloo-loopback" if cpu else "nvlink3"], args.intra_gbps,
                 args.intra_latency_us)
    inter = link(LINKS["gloo-loopback" if cpu else "hdr-ib"], args.inter_gbps,
                 args.inter_latency_us)
    return Cluster(device, per_node, args.devices // per_node, intra, inter), note


def format_plan(p) -> str:
    """The plan as a newcomer reads it: the configuration, the prediction, each stage."""
    par, pr, c = p.parallelism, p.predicted, p.cluster
    lines = [f"fitgraph plan-dist: {p.model} on {c['devices']} x {c['device']} "
             f"({c['nodes']} nodes of {c['devices_per_node']}), global batch {p.global_batch}, "
             f"seq {p.seq}, {p.precision}", f"device model   {p.device_note}"]
    if p.search:
        s = p.search
        lines.append(f"search         {s['candidates']} configurations, {s['evaluated']} "
                     f"evaluated, {s['simulated']} simulated, {p.plan_s:.2f} s")
    widths = ""
    if par.widths and len(set(par.widths)) > 1:
        widths = " (stages: " + ", ".join(f"tp {t} x dp {d}" for t, d in par.widths) + ")"
    lines += [
        "",
        f"parallelism    tp {par.tp} x pp {par.pp} x dp {par.dp}{widths}; micro-batch "
        f"{par.micro_batch}"
        f" x {par.n_micro}; schedule {par.schedule}"
        + (f" ({par.chunks} chunks)" if par.chunks > 1 else "")
        + f"; ZeRO-{par.zero}; sequence parallel {'on' if par.sp else 'off'}; recompute "
        f"{par.recompute}; gradient reduction {'overlapped' if par.overlap_grad_reduce else 'after backward'}",
        f"step           {pr['step_s']:.3f} s   ({pr['tokens_per_s']:,.0f} "
        f"{'tokens' if p.seq > 1 else 'samples'}/s, "
        f"{pr['tflops_per_device']:.1f} TFLOP/s per device, MFU {pr['mfu'] * 100:.1f}%)",
        f"peak memory    {pr['peak_bytes_per_device'] / GIB:.1f} GiB per device (budget "
        f"{pr['budget_bytes'] / GIB:.1f} GiB)" + ("" if p.fits else f"  DOES NOT FIT: {p.binding}"),
        "",
        f"{'stage':>5} {'tp x dp':>7} {'blocks':>14} {'busy s':>8} {'bubble':>7} {'tp comm':>8} {'dp sync':>8} "
        f"{'weights':>8} {'grads':>7} {'optim':>7} {'activ':>7} {'work':>6} {'peak GiB':>9}"
        f"  memory plan"]
    for s in p.stages:
        t, m = s["time"], s["memory"]
        blocks = s["blocks"]
        span = blocks[0] if len(blocks) == 1 else f"{blocks[0]}..{blocks[-1]}"
        plan = ", ".join(f"{k} x{n}" for k, n in s["memory_plan"].items())
        if s.get("offloaded_bytes"):
            plan += f"; {s['offloaded_bytes'] / GIB:.1f} GiB parked in host memory"
        lines.append(
            f"{s['index']:>5} {str(s.get('tp', par.tp)) + 'x' + str(s.get('dp', par.dp)):>7} "
            f"{span:>14} {t['busy_s']:>8.2f} {t['bubble_s']:>7.2f} "
            f"{t['tp_comm_s']:>8.2f} {t['dp_sync_s']:>8.3f} {m['weights'] / GIB:>8.1f} "
            f"{m['gradients'] / GIB:>7.1f} {m['optimizer'] / GIB:>7.1f} "
            f"{m['activations'] / GIB:>7.1f} {m['working'] / GIB:>6.1f} "
            f"{s['peak_bytes'] / GIB:>9.1f}  {plan}")
    lines += ["", "busy: compute per step (tensor-parallel collectives included); bubble: idle "
              "in the pipeline; dp sync: exposed gradient reduction; memory in GiB per device; "
              "memory plan: blocks that keep everything ('none'), re-make some ops in the "
              "backward ('drop:...'), or keep only their input ('full'), and how many."]
    return "\n".join(lines)


def cmd_plan_dist(args) -> int:
    require_model(args, "plan-dist")
    with progress.listening(not args.json):
        return _plan_dist(args)


def _plan_dist(args) -> int:
    from .dist.config import parse_fix
    from .dist.memory import PRECISIONS, Precision
    from .dist.planner import Infeasible, plan

    cluster, note = _cluster(args)
    with progress.stage(f"capturing and costing {args.model}"):
        shape = _model(args, cluster)
    try:
        fix = parse_fix(args.fix)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.emit_script:
        if fix.get("per_stage"):
            raise SystemExit("plan-dist --emit-script: the runtime does not run per-stage "
                             "widths yet: drop per_stage from --fix")
        # NOTE: a plan for the script is one the runtime runs: one width
        fix = {"per_stage": False, **fix}
    if args.optimizer == "muon":
        # NOTE: Muon orthogonalises whole matrices (parallelize refuses a shard of them)
        fix = {"tp": 1, "max_zero": 1, **fix}
    budget = args.budget_gib * GIB if args.budget_gib else None
    try:
        with progress.stage(f"planning {args.devices} devices" if not fix else
                            f"predicting {args.fix}"):
            p = plan(shape, cluster, args.global_batch, fix=fix,
                     precision=(args.precision if isinstance(args.precision, Precision)
                                else PRECISIONS[args.precision or "mixed-adam"]),
                     budget=budget, device_note=note)
    except Infeasible as e:
        if args.json:
            print(json.dumps({"fits": False, "error": str(e), "binding": e.binding,
                              "smallest_devices": e.smallest_devices}))
        else:
            print(f"fitgraph plan-dist: {e}")
        return 2
    except ValueError as e:
        raise SystemExit(f"plan-dist: {e}") from None
    if args.save:
        p.save(args.save)
    if args.emit_script:
        _emit_script(args, p)
    if args.plot:
        _plot(p, shape, cluster, args.plot)
    print(json.dumps(p.to_json(), indent=1) if args.json else format_plan(p))
    return 0 if p.fits else 3


def _emit_script(args, p) -> None:
    from pathlib import Path

    from .dist.megatron_table import GPT_PRESETS
    from .dist_script import script_text

    if args.model == "gpt" or args.model in GPT_PRESETS:
        raise SystemExit("plan-dist --emit-script: a model by its shape has no module to run; "
                         "plan a zoo model (fitgraph models)")
    script = Path(args.emit_script)
    plan_file = script.with_suffix(".plan.json")
    p.save(plan_file)
    dtype = args.dtype or ("float32" if p.cluster["device"].startswith("cpu") else "bfloat16")
    script.write_text(script_text(args.model, args.config, dtype, p.global_batch, p.seq,
                                  plan_file.name, p.parallelism.devices,
                                  args.optimizer or "adamw"))
    print(f"wrote {script} and {plan_file}: torchrun --nproc-per-node "
          f"{p.parallelism.devices} {script}")


def _plot(p, shape, cluster, path: str) -> None:
    from .dist.gantt import plot_gantt

    timeline = p.prediction.timeline if p.prediction is not None else None
    if timeline is None:
        return
    par = p.parallelism
    plot_gantt(timeline, path, title=f"{p.model}: tp {par.tp} x pp {par.pp} x dp {par.dp}, "
               f"{par.schedule}, {par.n_micro} micro-batches of {par.micro_batch}")
