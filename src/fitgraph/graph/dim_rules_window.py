"""Dimension rules of windowed ops: convolution, pooling, upsampling.

Along batch and channels they split like matrix products. Along a spatial dim the partition is
of the output rows; a part reads the input rows its windows cover (a halo, see
``Window.input_range``), explicitly padded where it touches the border. Windows that tile their
input (1x1 convolutions, kernel == stride, nearest upsampling by an integer factor) are plain
rows in units instead: no halo. In the backward the parts' input gradients cover overlapping
haloed rows and add where they overlap; a convolution's input gradient computed alone is
*gathered* instead (an output with a window: right inside the part), and so is bilinear
resampling's output (``Resample``).

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

from .dim_types import Along, Reduced, Resample, SizeArg, Split, Window, arg_of, per_arg

__all__ = ["BATCH_AND_CHANNELS", "avg_pool2d", "avg_pool2d_backward", "convolution",
           "convolution_backward", "max_pool2d", "max_pool2d_backward", "per_dim",
           "spatial_resample", "upsample_backward"]


def per_dim(value, n: int, name: str) -> list[int]:
    """A convolution's per-dim argument as ``n`` ints: ATen broadcasts one value to every
    spatial dim (``padding="valid"`` reaches ``aten.convolution`` as ``[0]``, its output
    padding too); ValueError for any other length (a rule treats that as no split)."""
    v = [value] if isinstance(value, int) else list(value)
    if len(v) == 1:
        return v * n
    if len(v) != n:
        raise ValueError(f"{name} {value!r} has {len(v)} entries for {n} spatial dims")
    return v


def _conv_windows(node, weight, n_spatial: int, arg0: int) -> list[Window | None]:
    """The window of each spatial dim; ``arg0`` is the position of ``stride`` in the args.
    None for a dim whose padding one value shares with the others (``padding=[1]``): a part
    could not zero it for its own dim alone."""
    stride, padding, dilation = (per_dim(arg_of(node, arg0 + i, name), n_spatial, name)
                                 for i, name in enumerate(("stride", "padding", "dilation")))
    raw = arg_of(node, arg0 + 1, "padding")
    shared = n_spatial > 1 and (isinstance(raw, int) or len(raw) == 1)
    wins: list[Window | None] = []
    for j in range(n_spatial):
        if shared and padding[j]:
            wins.append(None)
            continue
        path = () if shared else (arg0 + 1, j)  # NOTE: shared zero padding: nothing to zero
        wins.append(Window(weight[2 + j], stride[j], padding[j], dilation[j], "zero", path))
    return wins


def _spatial_input(win: Window, d: int, in_size: int, out_size: int) -> Along:
    """The input entry of a windowed op along spatial dim ``d``: plain rows when the windows
    tile the input (1x1 convolutions, 2x2 stride-2 patches), else read through the window."""
    tile = win.tiles(in_size, out_size)
    return Along(d, tile) if tile else Along(d, window=win)


def _transposed_tiles(node, w, x, out, j: int, arg0: int) -> int:
    """Output rows per input row of a transposed convolution whose kernel equals its stride
    (no padding, no output padding, no dilation): each input row makes its own output rows;
    0 otherwise (its halo runs the other way: not offered)."""
    n = len(x) - 2
    stride, padding, dilation, out_pad = (
        per_dim(arg_of(node, arg0 + i, name), n, name)[j]
        for i, name in ((0, "stride"), (1, "padding"), (2, "dilation"), (4, "output_padding")))
    k, d = w[2 + j], 2 + j
    if k == stride and not padding and not out_pad and dilation == 1 and out[d] == x[d] * k:
        return k
    return 0


def convolution(node, ins, outs) -> list[Split]:
    """convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    batch; output channels (by groups); input channels (no bias); spatial dims with a halo
    (plain rows when the windows tile the input).

    NOTE: transposed convolutions split spatially only when each input row makes its own
    output rows (kernel == stride, as U-Net's 2x2 up-convolutions); otherwise along the batch
    (their halo runs the other way)."""
    x, w, out = ins[0], ins[1], outs[0]
    has_bias = arg_of(node, 2, "bias") is not None
    transposed, groups = arg_of(node, 6, "transposed"), arg_of(node, 8, "groups")
    splits = []
    if x[0] >= 2:
        splits.append(Split(per_arg(node, {0: Along(0)}), (Along(0),)))
    if transposed:
        for j in range(len(x) - 2):
            d = 2 + j
            tile = _transposed_tiles(node, w, x, out, j, 3)
            if tile and x[d] >= 2:
                splits.append(Split(per_arg(node, {0: Along(d)}), (Along(d, tile),)))
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
        d = 2 + j
        if win is not None and out[d] >= 2:
            splits.append(Split(per_arg(node, {0: _spatial_input(win, d, x[d], out[d])}),
                                (Along(d),)))
    return splits


def convolution_backward(node, ins, outs) -> list[Split]:
    """convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask) -> (gx, gw, gb).

    Along a spatial dim the parts cut the output gradient's rows. With the weight (or bias)
    gradient requested, those are partial sums and the input gradients of neighbouring parts
    overlap by the halo and add (``Reduced(overlap=...)``). With the input gradient alone
    (``transform.fission_halo_grads`` separates them), a part *gathers*: its input gradient
    rows are complete where every output row that reads them is in the part — an output
    with a window, so that a region runs on through the backward of a convolution chain."""
    g, x, w = ins[0], ins[1], ins[2]
    transposed, groups = arg_of(node, 7, "transposed"), arg_of(node, 9, "groups")
    mask = arg_of(node, 10, "output_mask")
    splits = []
    if x[0] >= 2:
        b = Along(0)
        splits.append(Split((b, b, None), (b, Reduced(), Reduced()),
                            note="batch split: weight and bias gradients are partial sums"))
    if not transposed and groups >= 2:
        # NOTE: whole groups are independent convolutions: SegFormer's depthwise 3x3 backward
        # (512 channels at 2x2) takes a 4.5 MiB workspace on the CPU, its least peak's largest
        # item; along the channels each part takes its share
        cin, cout = x[1] // groups, w[0] // groups
        fix = [SizeArg((9,), ("in", 1), 1, cin)]
        if arg_of(node, 3, "bias_sizes"):
            fix.append(SizeArg((3, 0), ("in", 0), 1))
        splits.append(Split((Along(1, cout), Along(1, cin), Along(0, cout)),
                            (Along(1, cin), Along(0, cout), Along(0, cout)), sizes=tuple(fix),
                            note="channels split by whole groups"))
    if not transposed and groups == 1:
        if w[0] >= 2:
            bias_sizes = arg_of(node, 3, "bias_sizes")
            fix = (SizeArg((3, 0), ("in", 0), 1),) if bias_sizes else ()
            splits.append(Split((Along(1), None, Along(0)), (Reduced(), Along(0), Along(0)),
                                sizes=fix,
                                note="output channels split: the input gradient is a partial sum"))
        if x[1] >= 2 and not mask[2]:
            # NOTE: with the bias gradient requested every part would compute it whole: not offered
            splits.append(Split((None, Along(1), Along(1)), (Along(1), Along(1), None)))
    for j, win in enumerate(_conv_windows(node, w, len(x) - 2, 4)):
        d = 2 + j
        if g[d] < 2:
            continue
        if transposed:
            tile = _transposed_tiles(node, w, x, g, j, 4)
            if tile:
                splits.append(Split((Along(d, tile), Along(d), None),
                                    (Along(d), Reduced(), Reduced())))
            continue
        if win is None:
            continue
        tile = win.tiles(x[d], g[d])
        if tile:
            splits.append(Split((Along(d), Along(d, tile), None),
                                (Along(d, tile), Reduced(), Reduced()),
                                note="spatial split, windows tiling the input: no halo"))
        elif mask[1] or mask[2]:
            splits.append(Split((Along(d), Along(d, window=win), None),
                                (Reduced(overlap=Along(d, window=win)), Reduced(), Reduced()),
                                note="spatial split: input gradients of neighbouring parts "
                                     "overlap by the halo and add"))
        else:
            splits.append(Split((Along(d), Along(d, window=win), None),
                                (Along(d, window=win), None, None),
                                note="spatial split of the input gradient alone: gathered"))
    return splits


def _pool_params(node, first: int = 1, dilated: bool = True, fill: str = "-inf"
                 ) -> list[Window] | None:
    """A window per spatial dim of a pooling op whose args from ``first`` are (kernel, stride,
    padding[, dilation], ceil_mode): max_pool2d(x, ...) from 1, its backward(grad, x, ...)
    from 2; avg pooling has no dilation."""
    def two(v, default):
        v = default if v is None or (isinstance(v, (list, tuple)) and len(v) == 0) else v
        v = [v] if isinstance(v, int) else list(v)
        return v * 2 if len(v) == 1 else v
    kernel = two(arg_of(node, first, "kernel_size"), None)
    stride = two(arg_of(node, first + 1, "stride", []), kernel)
    raw_pad = arg_of(node, first + 2, "padding", 0)
    padding = two(raw_pad, 0)
    dilation = two(arg_of(node, first + 3, "dilation", 1), 1) if dilated else [1, 1]
    if arg_of(node, first + 3 + dilated, "ceil_mode", False):
        return None  # NOTE: ceil_mode adds a ragged last window; not offered
    wins = []
    for j in range(2):
        if padding[j] and not (isinstance(raw_pad, (list, tuple)) and len(raw_pad) == 2):
            return None  # NOTE: a shared padding value cannot be zeroed for one dim alone
        wins.append(Window(kernel[j], stride[j], padding[j], dilation[j], fill,
                           (first + 2, j) if padding[j] else ()))
    return wins


def _batch_channels(x, n_in: int, n_out: int = 1) -> list[Split]:
    return [Split((Along(i),) * n_in, (Along(i),) * n_out) for i in range(len(x) - 2)
            if x[i] >= 2]


def avg_pool2d(node, ins, outs) -> list[Split]:
    """avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    batch and channels; spatial dims with a halo, the part padding the border with zeros —
    which a window counts, so only when the op counts its padding too (or has none)."""
    x, out = ins[0], outs[0]
    splits = _batch_channels(x, 1)
    wins = _pool_params(node, 1, dilated=False, fill="zero") or ()
    if any(w.padding for w in wins) and not arg_of(node, 5, "count_include_pad", True):
        return splits  # NOTE: the divisor would count the part's explicit zero rows
    for j, win in enumerate(wins):
        d = len(x) - 2 + j  # NOTE: an unbatched (C, H, W) input pools its last two dims
        if out[d] >= 2:
            splits.append(Split(per_arg(node, {0: Along(d, window=win)}), (Along(d),)))
    return splits


def avg_pool2d_backward(node, ins, outs) -> list[Split]:
    """avg_pool2d_backward(grad, x, kernel, stride, padding, ceil_mode, count_include_pad,
    divisor_override): batch and channels; spatial dims gathered like a convolution's input
    gradient (no weight gradient to sum: always)."""
    g, x = ins[0], ins[1]
    splits = _batch_channels(x, 2)
    wins = _pool_params(node, 2, dilated=False, fill="zero") or ()
    if any(w.padding for w in wins) and not arg_of(node, 6, "count_include_pad", True):
        return splits
    for j, win in enumerate(wins):
        d = len(x) - 2 + j
        if g[d] >= 2:
            splits.append(Split(per_arg(node, {0: Along(d), 1: Along(d, window=win)}),
                                (Along(d, window=win),), note="gathered"))
    return splits


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
    indices): batch and channels; spatial dims gathered like a convolution's input gradient,
    the indices (flat positions in the whole input plane, or in the slice of the pooling's
    part) rebased to the part's own padded slice."""
    x = ins[1]
    splits = _batch_channels(x, 3)
    for j, win in enumerate(_pool_params(node, 2) or ()):
        d = len(x) - 2 + j
        if ins[0][d] >= 2:
            splits.append(Split((Along(d), Along(d, window=win), Along(d, rebase=True)),
                                (Along(d, window=win),), note="gathered"))
    return splits


_BILINEAR = ("aten.upsample_bilinear2d.default", "aten.upsample_bilinear2d_backward.default")
# NOTE: resampling whose rows are not offered (bicubic reads four source rows; the 3-D ones'
# scales are three): batch and channels only, each sample and channel resampled alone
BATCH_AND_CHANNELS = tuple(f"aten.upsample_{m}.default" for m in (
    "bicubic2d", "bicubic2d_backward", "trilinear3d", "trilinear3d_backward", "nearest3d",
    "nearest3d_backward"))


def _n_and_c(splits: list[Split]) -> list[Split]:
    """The splits along N and C alone (a 3-D op's depth, dim 2, is spatial too)."""
    return [sp for sp in splits if sp.operands[0].dim < 2]


def _scales(node, low, high, first_scale: int) -> list[int]:
    """Per spatial dim, the integer factor of an upsampling from ``low`` to ``high`` rows (0
    where it is not an integer, or an explicit scale argument says otherwise)."""
    out = []
    for j in range(len(low) - 2):
        d = 2 + j
        s = high[d] // low[d] if low[d] and high[d] % low[d] == 0 else 0
        given = arg_of(node, first_scale + j, ("scales_h", "scales_w")[j] if j < 2 else "")
        out.append(s if given is None or given == s else 0)
    return out


def spatial_resample(node, ins, outs) -> list[Split]:
    """upsample_nearest2d(x, output_size, scales_h, scales_w) / upsample_bilinear2d(x,
    output_size, align_corners, scales_h, scales_w): batch and channels; spatial dims when
    the factor is an integer. Nearest: each input row makes ``scale`` output rows (plain
    units). Bilinear (align_corners=False): an output row reads two input rows, so a part's
    rows are right only inside (``Resample``: an output with a window).

    NOTE: align_corners=True and fractional factors are not offered: the source coordinate
    of a row then depends on the whole tensor's size, not on the factor alone."""
    x, out = ins[0], outs[0]
    splits = [Split((Along(i),), (Along(i),)) for i in range(len(x) - 2) if x[i] >= 2]
    if node.target in BATCH_AND_CHANNELS:
        return _n_and_c(splits)
    bilinear = node.target in _BILINEAR
    if bilinear and arg_of(node, 2, "align_corners"):
        return splits
    for j, s in enumerate(_scales(node, x, out, 3 if bilinear else 2)):
        d = 2 + j
        if not s or x[d] < 2:
            continue
        size = (SizeArg((1, j), ("out", 0), d),)
        o = Along(d, window=Resample(s)) if bilinear else Along(d, s)
        splits.append(Split((Along(d),), (o,), sizes=size))
    return splits


def upsample_backward(node, ins, outs) -> list[Split]:
    """upsample_nearest2d_backward(grad, output_size, input_size, scales_h, scales_w) /
    upsample_bilinear2d_backward(grad, output_size, input_size, align_corners, scales_h,
    scales_w): batch and channels; spatial dims when the factor is an integer (a part reads
    ``scale`` gradient rows per input row; bilinear ones are complete inside the part)."""
    g, gi = ins[0], outs[0]
    splits = [Split((Along(i),), (Along(i),), sizes=(SizeArg((2, i), ("out", 0), i),))
              for i in range(len(g) - 2) if g[i] >= 2]
    if node.target in BATCH_AND_CHANNELS:
        return _n_and_c(splits)
    bilinear = node.target in _BILINEAR
    if bilinear and arg_of(node, 3, "align_corners"):
        return splits
    for j, s in enumerate(_scales(node, gi, g, 4 if bilinear else 3)):
        d = 2 + j
        if not s or gi[d] < 2:
            continue
        sizes = (SizeArg((1, j), ("in", 0), d), SizeArg((2, d), ("out", 0), d))
        o = Along(d, window=Resample(s, backward=True)) if bilinear else Along(d)
        splits.append(Split((Along(d, s),), (o,), sizes=sizes))
    return splits
