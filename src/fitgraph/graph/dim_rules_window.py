"""Dimension rules of windowed ops: convolution, pooling, upsampling.

Along batch and channels they split like matrix products. Along a spatial dim the partition is
of the output rows; a part reads the input rows its windows cover (a halo, see
``Window.input_range``), explicitly padded where it touches the border. In the backward the
parts' input gradients cover overlapping haloed rows and add where they overlap.

Example:
    >>> from fitgraph.graph.ir import Node, Phase, ValueRef
    >>> from fitgraph.graph.dim_rules_window import convolution
    >>> n = Node(0, "conv", "aten.convolution.default", (ValueRef(0), ValueRef(1), None,
    ...          [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}, (0, 1), (2,), (), Phase.FORWARD, "")
    >>> s = convolution(n, [(2, 3, 8, 8), (4, 3, 3, 3)], [(2, 4, 8, 8)])[-1]
    >>> s.operands[0].window
    Window(kernel=3, stride=1, padding=1, dilation=1, fill='zero', pad_path=(4, 1))
"""

from __future__ import annotations

from .dim_types import Along, Reduced, SizeArg, Split, Window, arg_of, per_arg

__all__ = ["convolution", "convolution_backward", "max_pool2d", "max_pool2d_backward",
           "spatial_resample", "upsample_backward"]


def _conv_windows(node, weight, n_spatial: int, arg0: int) -> list[Window]:
    """The window of each spatial dim; ``arg0`` is the position of ``stride`` in the args."""
    stride, padding, dilation = (arg_of(node, arg0 + i, name)
                                 for i, name in enumerate(("stride", "padding", "dilation")))
    return [Window(weight[2 + j], stride[j], padding[j], dilation[j], "zero", (arg0 + 1, j))
            for j in range(n_spatial)]


def convolution(node, ins, outs) -> list[Split]:
    """convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    batch; output channels (by groups); input channels (no bias); spatial dims with a halo.

    NOTE: transposed convolutions split along the batch only (their halo runs the other way)."""
    x, w, out = ins[0], ins[1], outs[0]
    has_bias = arg_of(node, 2, "bias") is not None
    transposed, groups = arg_of(node, 6, "transposed"), arg_of(node, 8, "groups")
    splits = []
    if x[0] >= 2:
        splits.append(Split(per_arg(node, {0: Along(0)}), (Along(0),)))
    if transposed:
        return splits
    if groups == 1 and w[0] >= 2:
        splits.append(Split(per_arg(node, {1: Along(0), 2: Along(0)}), (Along(1),)))
    elif groups >= 2:
        cin, cout = x[1] // groups, w[0] // groups
        splits.append(Split(per_arg(node, {0: Along(1, cin), 1: Along(0, cout), 2: Along(0, cout)}),
                            (Along(1, cout),), sizes=(SizeArg((8,), ("in", 0), 1, cin),),
                            note="channels split by whole groups"))
    if groups == 1 and x[1] >= 2 and not has_bias:
        splits.append(Split((Along(1), Along(1)), (Reduced(),),
                            note="input channels split: the parts' outputs are partial sums"))
    for j, win in enumerate(_conv_windows(node, w, len(x) - 2, 3)):
        if out[2 + j] >= 2:
            splits.append(Split(per_arg(node, {0: Along(2 + j, window=win)}), (Along(2 + j),)))
    return splits


def convolution_backward(node, ins, outs) -> list[Split]:
    """convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask) -> (gx, gw, gb)."""
    g, x, w = ins[0], ins[1], ins[2]
    transposed, groups = arg_of(node, 7, "transposed"), arg_of(node, 9, "groups")
    mask = arg_of(node, 10, "output_mask")
    splits = []
    if x[0] >= 2:
        b = Along(0)
        splits.append(Split((b, b, None), (b, Reduced(), Reduced()),
                            note="batch split: weight and bias gradients are partial sums"))
    if transposed or groups != 1:
        return splits  # NOTE: grouped/transposed backward: batch only (not in the zoo)
    if w[0] >= 2:
        bias_sizes = arg_of(node, 3, "bias_sizes")
        fix = (SizeArg((3, 0), ("in", 0), 1),) if bias_sizes else ()
        splits.append(Split((Along(1), None, Along(0)), (Reduced(), Along(0), Along(0)), sizes=fix,
                            note="output channels split: the input gradient is a partial sum"))
    if x[1] >= 2 and not mask[2]:
        # NOTE: with the bias gradient requested every part would compute it whole: not offered
        splits.append(Split((None, Along(1), Along(1)), (Along(1), Along(1), None)))
    for j, win in enumerate(_conv_windows(node, w, len(x) - 2, 4)):
        if g[2 + j] >= 2:
            d = 2 + j
            splits.append(Split((Along(d), Along(d, window=win), None),
                                (Reduced(overlap=Along(d, window=win)), Reduced(), Reduced()),
                                note="spatial split: input gradients of neighbouring parts "
                                     "overlap by the halo and add"))
    return splits


def _pool_params(node) -> list[Window] | None:
    """max_pool2d(x, kernel, stride, padding, dilation, ceil_mode): a window per spatial dim."""
    def two(v, default):
        v = default if v is None or (isinstance(v, (list, tuple)) and len(v) == 0) else v
        v = [v] if isinstance(v, int) else list(v)
        return v * 2 if len(v) == 1 else v
    kernel = two(arg_of(node, 1, "kernel_size"), None)
    stride = two(arg_of(node, 2, "stride", []), kernel)
    raw_pad = arg_of(node, 3, "padding", 0)
    padding = two(raw_pad, 0)
    dilation = two(arg_of(node, 4, "dilation", 1), 1)
    if arg_of(node, 5, "ceil_mode", False):
        return None  # NOTE: ceil_mode adds a ragged last window; not offered
    wins = []
    for j in range(2):
        if padding[j] and not (isinstance(raw_pad, (list, tuple)) and len(raw_pad) == 2):
            return None  # NOTE: a shared padding value cannot be zeroed for one dim alone
        wins.append(Window(kernel[j], stride[j], padding[j], dilation[j], "-inf",
                           (3, j) if padding[j] else ()))
    return wins


def max_pool2d(node, ins, outs) -> list[Split]:
    """max_pool2d_with_indices(x, ...) -> (out, indices): batch and channels; spatial dims
    with a halo, the indices rebased (they are flat positions in the part's input plane)."""
    x, out = ins[0], outs[0]
    nd = len(x)
    splits = [Split((Along(i),), (Along(i), Along(i))) for i in range(nd - 2) if x[i] >= 2]
    for j, win in enumerate(_pool_params(node) or ()):
        d = nd - 2 + j
        if out[d] >= 2:
            splits.append(Split((Along(d, window=win),), (Along(d), Along(d, rebase=True))))
    return splits


def max_pool2d_backward(node, ins, outs) -> list[Split]:
    """max_pool2d_with_indices_backward(grad, x, kernel, stride, padding, dilation, ceil,
    indices): batch and channels.

    NOTE: not along spatial dims: the indices are positions in the whole input plane, a part
    would need them re-based into its haloed slice."""
    x = ins[1]
    return [Split((Along(i),) * 3, (Along(i),)) for i in range(len(x) - 2) if x[i] >= 2]


def spatial_resample(node, ins, outs) -> list[Split]:
    """upsample_bilinear2d / upsample_nearest2d(x, output_size, ...): batch and channels.

    NOTE: not along spatial dims: a part's source coordinates depend on where it starts (and
    on align_corners); it would compute a cropped halo, which no rule here describes."""
    x = ins[0]
    return [Split((Along(i),), (Along(i),)) for i in range(len(x) - 2) if x[i] >= 2]


def upsample_backward(node, ins, outs) -> list[Split]:
    """upsample_*2d_backward(grad, output_size, input_size, ...): batch and channels."""
    g = ins[0]
    return [Split((Along(i),), (Along(i),), sizes=(SizeArg((2, i), ("out", 0), i),))
            for i in range(len(g) - 2) if g[i] >= 2]
