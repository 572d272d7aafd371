"""The layout's forward pass as an ONNX graph (the optional ``onnx`` extra).

The graph computes the equations of :mod:`layout.weights` for a batch of prefixes of one
length, in float32 (weights rounded to nearest float32, as :mod:`layout.formats`):

======================  ===============  =============================================
name                    shape            meaning
======================  ===============  =============================================
input ``tokens``        (N, T) int64     token ids (the vocabulary's order); BOS is
                                         prepended by the graph
output ``probs``        (N, V) float32   next-token distribution at the last position
output ``expert``       (N,) int64       the routed expert (top-1 of the gate)
output ``gate``         (N, K) float32   the gate scores g = W_G r + b_G
======================  ===============  =============================================

Operations, in order (each an ONNX operator run in float32): ``Gather`` of E rows plus
the first T + 1 rows of P; per head, ``MatMul`` for queries (last position), keys and
values, scores q·k_j with **no scaling**, ``Softmax`` over positions, the weighted sum of
values and ``MatMul`` by W_O; r = h_last + Σ heads (``Add``); the gate ``MatMul`` + ``Add``
and ``ArgMax`` (top-1); every expert's first layer at once (their neurons side by side),
``Relu``, and a ``Where`` that keeps only the routed expert's neurons (exact zeros
elsewhere, so the second layer's sum is the routed expert's alone: top-1 dispatch);
for ``top1-scaled`` the product by the routed expert's gate probability; y = r + that;
the logits ``MatMul`` by Uᵀ and ``Softmax``.

Every product and sum is one of those the float32 certificate of :mod:`verifier.passes.floating`
covers (any summation order, with or without FMA); ONNX Runtime's kernels run them in
orders of their choosing. Matrices are stored dense, so the file holds about
4·(V·d + d·Σ widths + ...) bytes; :func:`to_onnx` refuses models beyond 1.5 GB (the
protocol buffer limit is 2 GB).
"""

from __future__ import annotations

import numpy as np

from layout.formats import FORMATS, round_weights
from layout.weights import Weights
from tasks.errors import TaskError

LIMIT_BYTES = 1_500_000_000
OPSET = 17


def _require_onnx():
    try:
        import onnx
        from onnx import helper, numpy_helper
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise TaskError("ONNX export needs the onnx package", fix='pip install -e ".[onnx]"') from exc
    return onnx, helper, numpy_helper


def _dense_bytes(w: Weights) -> int:
    d, V, K = w.d, len(w.vocab), len(w.experts)
    width = sum(e.width for e in w.experts)
    heads = sum(2 * h.W_Q.shape[0] * d + 2 * h.W_V.shape[0] * d for h in w.heads)
    return 4 * ((V + 1) * d + w.P.shape[0] * d + heads + K * d + 2 * width * d + V * d)


def to_onnx(weights: Weights, source: str = "weights", metadata: dict[str, str] | None = None):
    """The ONNX model (an ``onnx.ModelProto``) of ``weights``' forward pass in float32;
    ``metadata`` is added to the model's properties (``export`` names the certified weights
    there: their digest and the precision they were certified for)."""
    onnx, helper, numpy_helper = _require_onnx()
    weights.validate(source)
    size = _dense_bytes(weights)
    if size > LIMIT_BYTES:
        raise TaskError(f"the dense float32 graph would hold {size / 1e9:.1f} GB of weights (ONNX files stop at 2 GB)",
                        file=source, fix="export a smaller task set; the certificate itself has no such limit")
    w = round_weights(weights, FORMATS["float32"], source)
    nodes, inits = [], []
    f32 = lambda M: np.asarray(M.toarray() if hasattr(M, "toarray") else M, np.float32)  # noqa: E731

    def init(name: str, array) -> str:
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(kind: str, inputs: list[str], name: str, **attrs) -> str:
        nodes.append(helper.make_node(kind, inputs, [name], name=f"{kind}_{name}", **attrs))
        return name

    d, V, K = w.d, len(w.vocab), len(w.experts)
    E, P = init("E", f32(w.E)), init("P", f32(w.P))
    # ids = [BOS, tokens...]; h = E[ids] + P[0..T]
    shape = op("Shape", ["tokens"], "tokens_shape")
    n = op("Slice", [shape, init("i0", np.array([0], np.int64)), init("i1", np.array([1], np.int64))], "batch")
    bos_shape = op("Concat", [n, init("one", np.array([1], np.int64))], "bos_shape", axis=0)
    bos = op("Expand", [init("bos", np.array([[w.bos]], np.int64)), bos_shape], "bos_column")
    ids = op("Concat", [bos, "tokens"], "ids", axis=1)
    T1 = op("Slice", [op("Shape", [ids], "ids_shape"), init("i1b", np.array([1], np.int64)),
                      init("i2", np.array([2], np.int64))], "length")
    Ppos = op("Slice", [P, init("z0", np.array([0], np.int64)), T1, init("ax0", np.array([0], np.int64))], "P_used")
    h = op("Add", [op("Gather", [E, ids], "E_rows", axis=0), Ppos], "h")                 # (N, T+1, d)
    last = op("Squeeze", [op("Slice", [h, init("m1", np.array([-1], np.int64)),
                                       init("big", np.array([2 ** 62], np.int64)),
                                       init("ax1", np.array([1], np.int64))], "h_last3"),
                          init("ax1s", np.array([1], np.int64))], "h_last")              # (N, d)
    r = last
    for m, head in enumerate(w.heads):
        WQ, WK = init(f"h{m}.W_Q_T", f32(head.W_Q).T.copy()), init(f"h{m}.W_K_T", f32(head.W_K).T.copy())
        WV, WO = init(f"h{m}.W_V_T", f32(head.W_V).T.copy()), init(f"h{m}.W_O_T", f32(head.W_O).T.copy())
        q = op("MatMul", [last, WQ], f"h{m}.q")                                          # (N, d_h)
        k = op("MatMul", [h, WK], f"h{m}.k")                                             # (N, T+1, d_h)
        s = op("MatMul", [k, op("Unsqueeze", [q, init(f"h{m}.axm1", np.array([-1], np.int64))], f"h{m}.q_col")],
               f"h{m}.s_col")                                                            # (N, T+1, 1)
        s = op("Transpose", [s], f"h{m}.s_row", perm=[0, 2, 1])                          # (N, 1, T+1)
        a = op("Softmax", [s], f"h{m}.a", axis=-1)
        v = op("MatMul", [h, WV], f"h{m}.v")                                             # (N, T+1, d_v)
        c = op("Squeeze", [op("MatMul", [a, v], f"h{m}.c3"), init(f"h{m}.ax1", np.array([1], np.int64))], f"h{m}.c")
        r = op("Add", [r, op("MatMul", [c, WO], f"h{m}.o")], f"r{m}")
    g = op("Add", [op("MatMul", [r, init("W_G_T", f32(w.W_G).T.copy())], "g_lin"), init("b_G", f32(w.b_G))], "gate")
    e = op("ArgMax", [g], "expert", axis=1, keepdims=0)                                  # (N,)
    widths = [x.width for x in w.experts]
    owner = np.repeat(np.arange(K, dtype=np.int64), widths)
    W1 = np.concatenate([f32(x.W_1) for x in w.experts], axis=0) if sum(widths) else np.zeros((0, d), np.float32)
    b1 = np.concatenate([f32(x.b_1) for x in w.experts]) if sum(widths) else np.zeros(0, np.float32)
    W2 = np.concatenate([f32(x.W_2) for x in w.experts], axis=1) if sum(widths) else np.zeros((d, 0), np.float32)
    z = op("Relu", [op("Add", [op("MatMul", [r, init("W_1_T", W1.T.copy())], "z_lin"), init("b_1", b1)], "z_pre")],
           "z_all")
    mine = op("Equal", [init("neuron_expert", owner[None, :]),
                        op("Unsqueeze", [e, init("ax1u", np.array([1], np.int64))], "expert_col")], "routed_neurons")
    z = op("Where", [mine, z, init("zero", np.zeros(1, np.float32))], "z")
    o = op("MatMul", [z, init("W_2_T", W2.T.copy())], "expert_out")                      # (N, d)
    if w.gate_mode == "top1-scaled":
        pg = op("Softmax", [g], "gate_probs", axis=-1)
        ce = op("GatherElements", [pg, "expert_col"], "gate_scale", axis=1)              # (N, 1)
        o = op("Mul", [o, ce], "expert_scaled")
    y = op("Add", [r, o], "y")
    logits = op("MatMul", [y, init("U_T", f32(w.U).T.copy())], "logits")
    op("Softmax", [logits], "probs", axis=-1)
    graph = helper.make_graph(
        nodes, "moe_knowledge",
        [helper.make_tensor_value_info("tokens", onnx.TensorProto.INT64, ["N", "T"])],
        [helper.make_tensor_value_info("probs", onnx.TensorProto.FLOAT, ["N", V]),
         helper.make_tensor_value_info("expert", onnx.TensorProto.INT64, ["N"]),
         helper.make_tensor_value_info("gate", onnx.TensorProto.FLOAT, ["N", K])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="moe-knowledge-verifier")
    model.doc_string = ("Single-layer MoE transformer in the layout of moe-knowledge-verifier (float32). Input tokens "
                        "(N, T) int64 without BOS; outputs probs (N, V), expert (N,), gate (N, K). Vocabulary in "
                        "metadata 'vocab' (JSON list).")
    import json

    helper.set_model_props(model, {"vocab": json.dumps(list(w.vocab), ensure_ascii=False),
                                   "expert_tasks": json.dumps(list(w.expert_tasks), ensure_ascii=False),
                                   "gate_mode": w.gate_mode, **(metadata or {})})
    onnx.checker.check_model(model)
    return model


def save_onnx(weights: Weights, path: str, source: str = "weights", metadata: dict[str, str] | None = None) -> None:
    """Write the ONNX model atomically."""
    from tasks.files import atomic_file

    model = to_onnx(weights, source, metadata)
    data = model.SerializeToString()
    with atomic_file(path) as f:
        f.write(data)
