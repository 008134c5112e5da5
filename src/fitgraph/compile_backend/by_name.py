"""``torch.compile(model, backend="fitgraph", options={...})``: the backend by its name.

fitgraph registers itself in torch's entry-point group ``torch_dynamo_backends``
(``pyproject.toml``), as third-party backends do: after ``pip install fitgraph`` the name works
without importing fitgraph, in torch.compile and wherever a tool passes a backend's name on
to torch (Accelerate's ``DynamoBackend`` list, and so Hugging Face Trainer's
``torch_compile_backend``, accept only names it knows: there, use
``fitgraph.integrations.huggingface.FitgraphCallback``). ``options`` are ``fitgraph.backend``'s arguments, by keyword (``budget``,
``latency_limit``, ``solver``, ``time_budget``, ``cost_model``, ``inner``, ``dynamic_shapes``,
``progress``). Where a tool gives no way to pass ``options``, the environment variable
``FITGRAPH_BACKEND_OPTIONS`` (a JSON object of the same keywords) is read instead. With
neither, the graphs run as torch's default partition saves (a report each, nothing planned).

One ``FitgraphBackend`` serves every graph compiled with one ``options`` dict (Dynamo calls the
backend once per graph break and per new shape): ``named_backend(options)`` returns it, with
its reports.

Example:
    >>> import torch, fitgraph
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64),
    ...                                                   torch.nn.GELU()) for _ in range(4)])
    >>> options = {"budget": 0.8}
    >>> compiled = torch.compile(model, backend="fitgraph", options=options)
    >>> compiled(torch.randn(256, 64)).square().mean().backward()
    >>> r = fitgraph.named_backend(options).last_report
    >>> r.planned_peak_bytes <= r.budget_bytes
    True
"""

from __future__ import annotations

import functools
import inspect
import json
import os

from .compiler import FitgraphBackend, backend

__all__ = ["ENV_OPTIONS", "compile_by_name", "named_backend"]

ENV_OPTIONS = "FITGRAPH_BACKEND_OPTIONS"
_OPTIONS = tuple(inspect.signature(backend).parameters)
# NOTE: keyed by the options dict's identity, holding the dict itself: torch.compile keeps the
# user's dict for the compiled model's life, so each call's graphs share one backend (its
# step-wide state: boundary holds, step shares), and a live dict's id is never reused
_BY_OPTIONS: dict[int, tuple[dict | None, FitgraphBackend]] = {}


def named_backend(options: dict | None = None) -> FitgraphBackend:
    """The backend that ``torch.compile(..., backend="fitgraph", options=options)`` compiles
    with (made on first use): its ``reports`` and ``last_report`` say what it planned. With
    ``options`` None: ``FITGRAPH_BACKEND_OPTIONS``'s, else none."""
    if options is None:
        options = _env_options()
    key = id(options) if options is not None else 0
    held = _BY_OPTIONS.get(key)
    if held is None or held[0] is not options:
        held = (options, backend(**_checked(options or {})))
        _BY_OPTIONS[key] = held
    return held[1]


def compile_by_name(gm, example_inputs, options: dict | None = None, mode: str | None = None):
    """The compiler function torch finds under the name "fitgraph" (entry point)."""
    if mode not in (None, "default"):
        raise ValueError(f"torch.compile(backend='fitgraph', mode={mode!r}): modes are "
                         "inductor's; pass fitgraph's arguments as options={...} (inner="
                         "'inductor' compiles the planned halves with inductor)")
    return named_backend(options)(gm, example_inputs)


def _checked(options: dict) -> dict:
    if not isinstance(options, dict):
        raise TypeError(f"options must be a dict of fitgraph.backend's arguments, not "
                        f"{type(options).__name__}")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"unknown fitgraph backend option(s) {', '.join(map(repr, unknown))}; "
                        f"known: {', '.join(_OPTIONS)}")
    return options


def _env_options() -> dict | None:
    text = os.environ.get(ENV_OPTIONS)
    return _parsed(text) if text else None


@functools.cache
def _parsed(text: str) -> dict:
    """``FITGRAPH_BACKEND_OPTIONS`` read; NOTE: cached, so that every graph compiled under one
    value gets the same dict, and so the same backend."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV_OPTIONS} is not JSON ({e}): give an object such as "
                         '\'{"budget": "8GiB"}\'') from e
