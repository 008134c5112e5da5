"""Torch's tracing errors, translated into one ``CaptureError`` that names the module, the op
and what to do.

make_fx traces the step on fake tensors, which hold shapes but no data, into one static graph
that every batch replays. What reads data into Python (``.item()``, ``.tolist()``, ``if
tensor``, ``.numpy()``) or makes a shape from data (``nonzero``, boolean-mask indexing) cannot
be in such a graph; torch reports it deep inside its dispatcher, in its own terms. Each kind
gets a message here with the user's source line (the innermost frame outside torch and
fitgraph) and the fix, and a mixture-of-experts layer that loops over the tokens each expert
got gets the static-shape route (``grouped_mm``) that fitgraph captures.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback

import torch

from .errors import CaptureError

__all__ = ["translate"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_FITGRAPH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep

_VALUE_READ = ("DataDependentOutputException", "GuardOnDataDependentSymNode")
_DYNAMIC_SHAPE = "DynamicOutputShapeException"
_SCALAR_OP = "aten._local_scalar_dense.default"
_READ_OP = f"{_SCALAR_OP} (.item(), .tolist(), float()/int()/bool() of a tensor)"


def _is_user(filename: str) -> bool:
    """A frame of the model or loss: not torch, fitgraph or the standard library (whose
    folder may hold site-packages, e.g. conda's: code there is the user's models)."""
    path = os.path.abspath(filename)
    if path.startswith((_TORCH_DIR, _FITGRAPH_DIR)):
        return False
    return not path.startswith(_STDLIB_DIR) or "-packages" + os.sep in path


def _source_line(e: BaseException) -> str:
    """`` at file:line: code`` of the innermost frame outside torch, fitgraph and the standard
    library: the line of the model or loss that did it; "" when there is none."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _is_user(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno}: `{(f.line or '').strip()}`"


def _moe_hint(model: torch.nn.Module | None, module: str) -> str:
    """What to do when the data-dependent module is a mixture-of-experts layer; "" otherwise."""
    if model is None:
        return ""
    try:
        mod = model.get_submodule(module)
    except AttributeError:
        return ""
    name = type(mod).__name__
    if not re.search(r"expert|moe", name, re.IGNORECASE):
        return ""
    # NOTE: transformers' @use_experts_implementation keeps the config on the experts module
    impl = getattr(getattr(mod, "config", None), "_experts_implementation", None)
    if impl is not None:
        return (f". {name} is a transformers experts module running experts_implementation="
                f"{impl!r}, a loop over the tokens each expert got: build the model with "
                "experts_implementation='grouped_mm' (transformers' default) or call "
                "model.set_experts_implementation('grouped_mm'); fitgraph captures grouped_mm, "
                "whose shapes do not depend on the routing")
    return (f". {name} looks like a mixture-of-experts layer that loops over the tokens each "
            "expert got; give it static shapes: sort the token-expert pairs by expert and run "
            "torch.nn.functional.grouped_mm with the cumulative counts as offsets, as "
            "transformers' grouped_mm experts do")


def translate(e: Exception, module: str, model: torch.nn.Module | None = None) -> CaptureError:
    """The CaptureError for exception ``e`` raised while tracing, in ``module`` of ``model``."""
    kind = type(e).__name__
    op = getattr(e, "func", None)
    op_name = str(op) if op is not None else None
    msg = str(e).strip().splitlines()[0] if str(e).strip() else kind
    at = _source_line(e)
    custom = re.search(r"no fake impl registered for <CustomOpDef\((.*?)\)>", msg)
    if custom:
        kind, op_name = "UnsupportedOperatorException", custom.group(1).replace("::", ".")
    if kind in _VALUE_READ or "_local_scalar_dense" in msg:
        return CaptureError(
            f"data-dependent Python: the step reads a tensor's value into Python{at} ({kind}). "
            "fitgraph captures one static graph that every batch replays, so a value that "
            "steers Python (a branch, a loop count, a shape, a Python scalar) cannot be in "
            "it: keep it a tensor (torch.where(cond, a, b) instead of `if tensor`, multiply "
            "by the tensor instead of its .item()), or compute it outside the step (e.g. into "
            "the batch)" + _moe_hint(model, module),
            module=module, op=_READ_OP if op_name in (None, _SCALAR_OP) else op_name)
    if kind == _DYNAMIC_SHAPE or "data-dependent" in msg.lower():
        return CaptureError(
            f"data-dependent output shape: {op_name or 'an op'} returns as many elements as the "
            f"data selects{at} (nonzero, boolean-mask indexing x[mask], one-argument "
            "torch.where, masked_select, unique, ...). fitgraph captures one static graph: "
            "keep shapes fixed: multiply by the mask or torch.where(mask, x, 0) and reduce, or "
            "index with fixed-size indices (topk, sort, gather/scatter)" + _moe_hint(model, module),
            module=module, op=op_name)
    if ".numpy() is not supported" in msg:
        return CaptureError(
            f"the step converts a tensor to NumPy{at}: fitgraph traces the step on fake "
            "tensors, which hold no data, and NumPy results leave the graph (no gradient, not "
            "replayed). Use torch ops instead (torch has most NumPy functions), or compute it "
            "outside the step (precompute it into the batch or a buffer)",
            module=module, op=".numpy()")
    if msg.startswith("_apply(): Couldn't swap"):
        return CaptureError(
            f"the module converts its own parameters during forward{at} (module.to(...), "
            f".float(), .half(): {msg}); fitgraph traces with fake parameters in their place, "
            "which cannot be converted in place, and a step graph cannot change a parameter's "
            "dtype or device. Convert the model before handing it to fitgraph and remove the "
            "conversion from forward", module=module, op="Module.to() in forward")
    if kind == "UnsupportedOperatorException":
        return CaptureError(
            f"op {op_name} has no fake-tensor (meta) implementation{at}, so it cannot be traced "
            "without real memory; register a fake kernel with torch.library.register_fake or "
            "rewrite it with supported ops", module=module, op=op_name)
    return CaptureError(f"tracing failed with {kind}: {msg}{at}", module=module, op=op_name)
