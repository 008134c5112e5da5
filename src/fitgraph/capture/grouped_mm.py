"""``aten._grouped_mm`` (the grouped GEMM of mixture-of-experts layers): a fake kernel that
traces what the real kernels accept, and its FLOPs.

``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``: the default experts implementation
of Hugging Face MoE layers in transformers 5, ``experts_implementation="grouped_mm"``) is the
case that needs it: its meta kernel (``torch/_meta_registrations.py``) accepts only bfloat16,
while the CPU kernel and CUDA's (``_grouped_mm_validate_inputs`` in ATen's GroupedMMUtils.h)
accept float32, bfloat16 and float16 — the non-bf16 ones by a loop of ``mm`` per group. So an
fp32 Mixtral trains in eager and failed to trace. The kernel below checks what the real
kernels check and builds the output as they do (``create_grouped_gemm_output_tensor``: the
last dimension padded to 16 bytes), so the captured graph holds the op eager runs, with the
strides (and bytes) it allocates.

Only fitgraph's own FakeTensorMode uses the kernel (``fake_mode.CaptureFakeMode``): torch's
registries and other fake modes in the process are left as they are. torch has no FLOP formula
for the op either (``torch.utils.flop_counter``); ``grouped_mm_flops`` is the one the roofline
cost model needs.
"""

from __future__ import annotations

import torch

__all__ = ["grouped_mm_fake", "grouped_mm_flops"]

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # NOTE: the real kernels' list
TMA_ALIGN_BYTES = 16  # NOTE: the kernels pad the output's last dim to 16 bytes (TMA alignment)


def _check_strides(name: str, mat: torch.Tensor) -> None:
    """``check_valid_strides_and_return_transposed``: row- or column-major in the last two
    dimensions, the leading stride a multiple of 16 bytes."""
    last = mat.dim() - 1
    align = TMA_ALIGN_BYTES // mat.element_size()
    st, sz = mat.stride(), mat.shape
    if st[last - 1] == 1 and st[last] >= max(1, sz[last - 1]):
        lead = st[last]
    elif st[last] == 1 and st[last - 1] >= max(1, sz[last]):
        lead = st[last - 1]
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {list(st)} for strides and "
                           f"{list(sz)} for sizes ({name})")
    torch._check(lead % align == 0, lambda: f"{name}: strides should be multiple of 16 bytes")


def grouped_mm_fake(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``aten._grouped_mm`` as ATen's CPU/CUDA kernel validates and allocates it. The output
    shape depends on shapes only (``offs`` values pick rows, not sizes): a static graph.
    NotImplemented (torch's meta kernel decides) off the CPU and CUDA builds whose kernels
    this mirrors."""
    if mat_a.device.type not in ("cpu", "cuda") or torch.version.hip:
        return NotImplemented
    for name, m in (("mat_a", mat_a), ("mat_b", mat_b)):
        if m.dtype not in GROUPED_MM_DTYPES:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16, got {m.dtype}")
        if m.dim() not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    torch._check(mat_a.dtype == mat_b.dtype,
                 lambda: f"mat_a and mat_b dtypes differ: {mat_a.dtype} != {mat_b.dtype}")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a2 and b2):
        torch._check(mat_a.size(-1) == mat_b.size(-2),
                     lambda: "contraction dimension of mat_a and mat_b must match")
    _check_strides("mat_a", mat_a)
    _check_strides("mat_b", mat_b)
    torch._check((offs is not None) == (a2 or b2), lambda: "Have to provide offsets if there "
                 "is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        torch._check(offs.dim() == 1 and offs.dtype == torch.int32,
                     lambda: "offs has to be a 1D int32 tensor")
    torch._check(bias is None, lambda: "Bias not supported yet")
    dtype = out_dtype or mat_a.dtype
    torch._check(dtype == mat_a.dtype, lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    if a2 and b2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        torch._check(offs.size(0) == mat_b.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        torch._check(offs.size(0) == mat_a.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        torch._check(mat_a.size(0) == mat_b.size(0), lambda: "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    align = TMA_ALIGN_BYTES // dtype.itemsize
    padded = (size[-1] + align - 1) // align * align
    stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


def grouped_mm_flops(mat_a: torch.Tensor, mat_b: torch.Tensor, *args, **kwargs) -> float:
    """2·M·K·N multiply-adds of every layout: each output element is one dot product over the
    contraction (split into groups in the 2D x 2D layout, whose G outputs each cover a part).
    Rows past ``offs[-1]`` are skipped by the kernel; the count assumes none (as in Hugging
    Face's experts without expert parallelism, where every token-expert pair has a group)."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        m, k, n = mat_a.size(0), mat_a.size(1), mat_b.size(1)
    elif a2:
        m, k, n = mat_a.size(0), mat_a.size(1), mat_b.size(-1)
    elif b2:
        m, k, n = mat_a.size(1), mat_a.size(2), mat_b.size(1)
    else:
        return 2.0 * mat_a.size(0) * mat_a.size(1) * mat_a.size(2) * mat_b.size(-1)
    return 2.0 * m * k * n
