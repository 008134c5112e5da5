"""Synthetic transformer-like training graphs of any size, built with GraphBuilder (no torch).

``transformer_like(layers)`` makes what a capture of a pre-LN transformer looks like to the
planner: per block a layer norm, a QKV projection viewed into heads, attention scores, softmax,
a dropout in-place chain (``empty_like -> bernoulli_ -> div_``, random), the attention output,
an MLP with GELU, residual adds; a loss; the backward in reverse, reading what autograd saves;
weight gradients as step outputs. About 41 nodes per block, so 250 blocks give 10,000+ nodes in
well under a second. Nodes carry FLOPs and bytes moved, for the roofline cost model.
"""

from __future__ import annotations

from fitgraph.graph.ir import Graph, GraphBuilder, Phase, Role

F32 = "float32"
FWD, BWD = Phase.FORWARD, Phase.BACKWARD


def transformer_like(layers: int, batch: int = 2, seq: int = 64, d: int = 64,
                     heads: int = 4) -> Graph:
    b = GraphBuilder()
    B, T, H, dh = batch, seq, heads, d // heads
    act, big, att = (B, T, d), (B, T, 4 * d), (B, H, T, T)

    def op(target, ins, shapes, phase=FWD, module="", flops=0.0, **kw):
        return b.add_node(target, ins, [(s, F32) for s in shapes], phase=phase, module=module,
                          flops=flops, **kw)

    def param(name, shape):
        return b.add_input(f"param:{name}", shape, F32, Role.PARAMETER)

    def mm(x, w, shape, phase=FWD, module=""):
        n = 1
        for s in shape:
            n *= s
        return op("aten.mm.default", [x, w], [shape], phase, module, flops=2.0 * n * d)[0]

    x = b.add_input("batch:0", act, F32, Role.INPUT)
    saved, grads = [], {}
    for i in range(layers):
        m = f"h.{i}"
        w = {k: param(f"{m}.{k}", s) for k, s in (("ln1", (d,)), ("qkv", (d, 3 * d)),
                                                  ("o", (d, d)), ("ln2", (d,)),
                                                  ("fc1", (d, 4 * d)), ("fc2", (4 * d, d)))}
        y1, mu1, rs1 = op("aten.native_layer_norm.default", [x, w["ln1"]],
                          [act, (B, T, 1), (B, T, 1)], module=f"{m}.ln_1")
        qkv = mm(y1, w["qkv"], (B, T, 3 * d), module=f"{m}.attn")
        q, k, v = (op("aten.select.int", [qkv], [(B, H, T, dh)], module=f"{m}.attn",
                      alias_of={0: qkv})[0] for _ in range(3))
        s = op("aten.bmm.default", [q, k], [att], module=f"{m}.attn", flops=2.0 * B * H * T * T * dh)[0]
        p = op("aten._softmax.default", [s], [att], module=f"{m}.attn")[0]
        mask = op("aten.empty_like.default", [p], [att], module=f"{m}.attn")[0]
        mask = op("aten.bernoulli_.float", [mask], [att], module=f"{m}.attn", random=True,
                  mutates=(mask,), alias_of={0: mask})[0]
        mask = op("aten.div_.Scalar", [mask], [att], module=f"{m}.attn", mutates=(mask,),
                  alias_of={0: mask})[0]
        pd = op("aten.mul.Tensor", [p, mask], [att], module=f"{m}.attn")[0]
        a = op("aten.bmm.default", [pd, v], [(B, H, T, dh)], module=f"{m}.attn",
               flops=2.0 * B * H * T * T * dh)[0]
        a2 = op("aten.view.default", [a], [act], module=f"{m}.attn", alias_of={0: a})[0]
        o = mm(a2, w["o"], act, module=f"{m}.attn")
        x1 = op("aten.add.Tensor", [x, o], [act], module=m)[0]
        y2, mu2, rs2 = op("aten.native_layer_norm.default", [x1, w["ln2"]],
                          [act, (B, T, 1), (B, T, 1)], module=f"{m}.ln_2")
        h = mm(y2, w["fc1"], big, module=f"{m}.mlp")
        ga = op("aten.gelu.default", [h], [big], module=f"{m}.mlp")[0]
        f = mm(ga, w["fc2"], act, module=f"{m}.mlp")
        saved.append((x, y1, mu1, rs1, q, k, v, p, mask, pd, a2, x1, y2, mu2, rs2, h, ga, w))
        x = op("aten.add.Tensor", [x1, f], [act], module=m)[0]
    loss = op("aten.mean.default", [x], [()], phase=Phase.LOSS)[0]
    gx = op("aten.expand.default", [loss], [act], phase=BWD)[0]
    for i in reversed(range(layers)):
        x0, y1, mu1, rs1, q, k, v, p, mask, pd, a2, x1, y2, mu2, rs2, h, ga, w = saved[i]
        grads[f"h.{i}.fc2"] = mm(ga, gx, (4 * d, d), BWD)
        dga = mm(gx, w["fc2"], big, BWD)
        dh = op("aten.gelu_backward.default", [dga, h], [big], BWD)[0]
        grads[f"h.{i}.fc1"] = mm(y2, dh, (d, 4 * d), BWD)
        dy2 = mm(dh, w["fc1"], act, BWD)
        dx1, grads[f"h.{i}.ln2"] = op("aten.native_layer_norm_backward.default",
                                      [dy2, x1, mu2, rs2, w["ln2"]], [act, (d,)], BWD)
        dx1 = op("aten.add.Tensor", [dx1, gx], [act], BWD)[0]
        grads[f"h.{i}.o"] = mm(a2, dx1, (d, d), BWD)
        da = mm(dx1, w["o"], (B, H, T, dh), BWD)
        dpd = op("aten.bmm.default", [da, v], [att], BWD)[0]
        dv = op("aten.bmm.default", [pd, da], [(B, H, T, dh)], BWD)[0]
        dp = op("aten.mul.Tensor", [dpd, mask], [att], BWD)[0]
        ds = op("aten._softmax_backward_data.default", [dp, p], [att], BWD)[0]
        dq = op("aten.bmm.default", [ds, k], [(B, H, T, dh)], BWD)[0]
        dk = op("aten.bmm.default", [ds, q], [(B, H, T, dh)], BWD)[0]
        dqkv = op("aten.cat.default", [dq, dk, dv], [(B, T, 3 * d)], BWD)[0]
        grads[f"h.{i}.qkv"] = mm(y1, dqkv, (d, 3 * d), BWD)
        dy1 = mm(dqkv, w["qkv"], act, BWD)
        dx, grads[f"h.{i}.ln1"] = op("aten.native_layer_norm_backward.default",
                                     [dy1, x0, mu1, rs1, w["ln1"]], [act, (d,)], BWD)
        gx = op("aten.add.Tensor", [dx, dx1], [act], BWD)[0]
    g = b.finish({"loss": loss, **{f"grad:{k}": v for k, v in grads.items()}})
    for n in g.nodes:  # NOTE: bytes read + written, as capture fills them, for the roofline
        n.bytes_moved = sum(g.values[v].nbytes for v in (*n.inputs, *n.outputs) if v is not None)
    return g
