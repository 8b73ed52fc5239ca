"""Find the attention sites of an imported Relax function (analysis used by the rewrite pass).

An attention site is causal self-attention over the block, in one of two imported forms:

  1. ``matmul → [scale] → + causal mask → softmax → [NaN-row guard] → matmul`` — what
     ``F.scaled_dot_product_attention(..., is_causal=True)`` and eager attention with a
     constant triangular mask become after ``torch.export`` + ``relax.frontend.torch``.
  2. ``R.nn.attention(q, k, v, causal_mask="TopLeft")`` (SDPA imported without decompositions).

For every site the matcher recovers, independent of any model class:
  * ``q`` [1, Hq, T, d], ``k``/``v`` [1, H, T, d] — the tensors *before* GQA head expansion
    and transposes (post-RoPE for q/k: whatever the graph computed before attention);
  * the softmax scale (product of every scalar factor on the q, k and score paths);
  * the site's output binding and the layout to rebuild it from [1, Hq, T, d].
Nothing is guessed from names or shapes alone: the data-movement chains between q/k/v and the
matmuls (reshape, broadcast_to, expand_dims, permute_dims, repeat, scalar multiply) and the mask
subgraph are *evaluated* with numpy on probe tensors and compared with what causal GQA attention
requires (head h reads KV head h // (Hq/H); mask = 0 on/below the diagonal, −inf above).
Anything else raises ``AttentionMatchError`` naming the operators it found.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

LAYOUT_OPS = {"relax.reshape", "relax.broadcast_to", "relax.expand_dims", "relax.permute_dims", "relax.repeat"}
SCALE_OPS = {"relax.multiply", "relax.divide"}


class AttentionMatchError(ValueError):
    """The graph has no attention site, or one the pass cannot match; the message says what was found."""


@dataclass
class AttentionSite:
    index: int
    q: relax.Var
    k: relax.Var
    v: relax.Var
    num_q_heads: int
    num_kv_heads: int
    seq_len: int
    head_dim: int
    sm_scale: float
    output: relax.Var  # the binding replaced by the block-attention kernel
    output_layout: str  # "bhtd": output = reshape(out[1,Hq,T,d]); "bthd": permute to [1,T,Hq,d] first
    form: str
    ops_seen: list[str] = field(default_factory=list)


def op_name(expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def shape_of(expr) -> tuple[int, ...] | None:
    ty = expr.ty if hasattr(expr, "ty") else None
    shape = getattr(ty, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(x) for x in shape.values)
    except (TypeError, AttributeError):
        return None


def dtype_of(expr) -> str:
    return str(getattr(expr.ty, "dtype", ""))


def is_const(expr) -> bool:
    return type(expr).__name__ in ("GenericConst", "Constant")


def const_value(expr) -> np.ndarray:
    return expr.value.numpy()


class Graph:
    """Bindings of one function, by variable."""

    def __init__(self, func: relax.Function):
        self.func = func
        self.producer: dict = {}
        self.order: list = []
        self.users: dict = {}
        body = func.body
        if not isinstance(body, relax.SeqExpr):
            raise AttentionMatchError("the function body is not a sequence of bindings")
        for block in body.blocks:
            for b in block.bindings:
                if not isinstance(b, relax.VarBinding):
                    raise AttentionMatchError(f"unsupported binding kind {type(b).__name__} (match_cast)")
                self.producer[b.var] = b.value
                self.order.append(b.var)
                for a in _arg_vars(b.value):
                    self.users.setdefault(a, []).append(b.var)
        self.params = set(func.params)

    def const_of(self, expr):
        """``expr`` itself, or the constant a var is bound to."""
        while isinstance(expr, relax.Var) and expr in self.producer:
            expr = self.producer[expr]
        return expr

    def value(self, var):
        """The bound value, looking through plain var-to-var and constant bindings."""
        return self.producer.get(var)

    def depends_on_params(self, expr, _memo=None) -> bool:
        memo = {} if _memo is None else _memo
        if isinstance(expr, relax.Var) or type(expr).__name__ == "DataflowVar":
            if expr in memo:
                return memo[expr]
            if expr in self.params:
                memo[expr] = True
                return True
            val = self.producer.get(expr)
            memo[expr] = False
            res = val is not None and any(self.depends_on_params(a, memo) for a in _arg_exprs(val))
            memo[expr] = res
            return res
        return any(self.depends_on_params(a, memo) for a in _arg_exprs(expr))

    def ops_in(self, expr, acc=None, seen=None) -> list[str]:
        acc = [] if acc is None else acc
        seen = set() if seen is None else seen
        if isinstance(expr, relax.Var):
            if expr in seen or expr not in self.producer:
                return acc
            seen.add(expr)
            expr = self.producer[expr]
        name = op_name(expr)
        if name and name not in acc:
            acc.append(name)
        for a in _arg_exprs(expr):
            self.ops_in(a, acc, seen)
        return acc


def _arg_exprs(expr):
    if isinstance(expr, relax.Call):
        out = []
        for a in expr.args:
            if isinstance(a, relax.Tuple):
                out.extend(a.fields)
            else:
                out.append(a)
        return out
    if isinstance(expr, relax.Tuple):
        return list(expr.fields)
    if isinstance(expr, relax.TupleGetItem):
        return [expr.tuple_value]
    return []


def _arg_vars(expr):
    return [a for a in _arg_exprs(expr) if isinstance(a, relax.Var)]


# ---- a tiny numpy interpreter for data-movement chains and constant mask subgraphs ---------

class _Unsupported(Exception):
    pass


def _scalar_of(expr):
    if is_const(expr):
        v = const_value(expr)
        if v.size == 1:
            return float(v.reshape(()))
    return None


def evaluate(graph: Graph, expr, leaves: dict, memo=None):
    """Evaluate ``expr`` with numpy; ``leaves`` maps vars to arrays. Raises _Unsupported(op)."""
    memo = {} if memo is None else memo
    if isinstance(expr, relax.Var):
        if expr in leaves:
            return leaves[expr]
        if expr in memo:
            return memo[expr]
        if expr not in graph.producer:
            raise _Unsupported(f"input '{expr.name}'")
        val = evaluate(graph, graph.producer[expr], leaves, memo)
        memo[expr] = val
        return val
    if is_const(expr):
        return const_value(expr)
    if isinstance(expr, relax.ShapeExpr):
        return tuple(int(x) for x in expr.values)
    if type(expr).__name__ == "IntImm":
        return int(expr.value)
    if type(expr).__name__ == "FloatImm":
        return float(expr.value)
    name = op_name(expr)
    if name is None:
        raise _Unsupported(type(expr).__name__)
    a = [evaluate(graph, x, leaves, memo) for x in expr.args] if name != "relax.concat" else None
    at = expr.attrs
    if name == "relax.reshape":
        return np.reshape(a[0], a[1])
    if name == "relax.broadcast_to":
        return np.broadcast_to(a[0], a[1])
    if name == "relax.expand_dims":
        return np.expand_dims(a[0], tuple(int(x) for x in at.axis))
    if name == "relax.permute_dims":
        axes = None if at.axes is None else [int(x) for x in at.axes]
        return np.transpose(a[0], axes)
    if name == "relax.repeat":
        return np.repeat(a[0], int(at.repeats), axis=None if at.axis is None else int(at.axis))
    if name == "relax.squeeze":
        return np.squeeze(a[0], None if at.axis is None else tuple(int(x) for x in at.axis))
    if name in ("relax.multiply", "relax.divide", "relax.add", "relax.subtract"):
        fn = {"relax.multiply": np.multiply, "relax.divide": np.divide, "relax.add": np.add,
              "relax.subtract": np.subtract}[name]
        return fn(a[0], a[1])
    if name in ("relax.less", "relax.less_equal", "relax.greater", "relax.greater_equal", "relax.equal",
                "relax.not_equal"):
        fn = {"relax.less": np.less, "relax.less_equal": np.less_equal, "relax.greater": np.greater,
              "relax.greater_equal": np.greater_equal, "relax.equal": np.equal, "relax.not_equal": np.not_equal}[name]
        return fn(a[0], a[1])
    if name in ("relax.logical_and", "relax.logical_or"):
        return (np.logical_and if name == "relax.logical_and" else np.logical_or)(a[0], a[1])
    if name == "relax.logical_not":
        return np.logical_not(a[0])
    if name == "relax.where":
        return np.where(a[0], a[1], a[2])
    if name == "relax.full":
        return np.full(a[0], a[1], dtype=str(at.dtype))
    if name == "relax.full_like":
        return np.full_like(a[0], a[1], dtype=None if at.dtype is None or str(at.dtype) in ("", "void") else str(at.dtype))
    if name == "relax.zeros":
        return np.zeros(a[0], dtype=str(at.dtype))
    if name == "relax.ones":
        return np.ones(a[0], dtype=str(at.dtype))
    if name == "relax.arange":
        return np.arange(a[0], a[1], a[2], dtype=str(at.dtype))
    if name == "relax.astype":
        return a[0].astype(str(at.dtype))
    if name in ("relax.tril", "relax.triu"):
        k = int(a[1]) if len(a) > 1 else 0
        return (np.tril if name == "relax.tril" else np.triu)(a[0], k)
    raise _Unsupported(name)


# ---- matching ------------------------------------------------------------------------------

def _chain_scale(graph: Graph, root, out_var) -> float:
    """The product of scalar factors between root and out_var (evaluated on ones)."""
    shape = shape_of(root)
    ones = np.ones(shape, dtype=np.float64)
    res = evaluate(graph, out_var, {root: ones})
    vals = np.unique(np.asarray(res))
    if vals.size != 1:
        raise AttentionMatchError("a q/k/v chain is not a pure data movement times a scalar")
    return float(vals[0])


def _check_chain(graph, root, out_var, expected_fn, what) -> float:
    """Evaluate root → out_var on an iota probe and compare with expected_fn(probe)·scale."""
    shape = shape_of(root)
    probe = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + 1.0
    try:
        scale = _chain_scale(graph, root, out_var)
        got = np.asarray(evaluate(graph, out_var, {root: probe}), dtype=np.float64)
    except _Unsupported as exc:
        raise AttentionMatchError(f"{what}: cannot follow operator {exc} between the tensor and the matmul") from None
    want = expected_fn(probe) * scale
    if got.size != want.size or not np.array_equal(got.reshape(-1), want.reshape(-1)):
        raise AttentionMatchError(f"{what}: the data movement before the matmul is not the expected "
                                  f"GQA head expansion / transpose (shapes {shape} → {shape_of(out_var)})")
    return scale


def _chain_nodes(graph: Graph, var, through: set[str]):
    """var and every tensor reached by walking back through single-input layout/scalar ops."""
    nodes = [var]
    cur = var
    while True:
        val = graph.producer.get(cur) if isinstance(cur, relax.Var) else None
        name = op_name(val)
        nxt = None
        if name in through and name in LAYOUT_OPS:
            nxt = val.args[0]
        elif name in through and name in SCALE_OPS:
            if _scalar_of(val.args[1]) is not None:
                nxt = val.args[0]
            elif name == "relax.multiply" and _scalar_of(val.args[0]) is not None:
                nxt = val.args[1]
        if nxt is None:
            return nodes
        nodes.append(nxt)
        cur = nxt


def _pick_root(graph, operand, through, T, D, Hq, expected, what, only_heads=None):
    """The tensor [1, h, T, D] (fewest heads, then farthest from the matmul) from which ``operand``
    is obtained by exactly the expected data movement (checked numerically)."""
    nodes = _chain_nodes(graph, operand, through)
    cands = []
    for dist, node in enumerate(nodes):
        s = shape_of(node)
        if s and len(s) == 4 and s[0] == 1 and s[2] == T and s[3] == D and Hq % s[1] == 0:
            if only_heads is None or s[1] == only_heads:
                cands.append((s[1], dist, node))
    if not cands:
        shapes = [shape_of(n) for n in nodes]
        raise AttentionMatchError(f"{what}: no tensor of shape [1, heads, {T}, {D}] on the path to the matmul "
                                  f"(shapes seen: {shapes})")
    last_err = None
    for h, _, node in sorted(cands, key=lambda c: (c[0], -c[1])):
        G = Hq // h
        try:
            return node, _check_chain(graph, node, operand, lambda x, G=G: expected(x, G), what)
        except AttentionMatchError as exc:
            last_err = exc
    raise last_err


def _mask_is_causal(graph: Graph, mask_expr, seq: int, kind: str) -> None:
    if graph.depends_on_params(mask_expr):
        ops = graph.ops_in(mask_expr)
        raise AttentionMatchError(
            "the attention mask depends on the function's inputs (ops: " + ", ".join(ops) + "); only a constant "
            "causal mask is supported — export with scaled_dot_product_attention(is_causal=True)")
    try:
        m = np.asarray(evaluate(graph, mask_expr, {}))
    except _Unsupported as exc:
        ops = graph.ops_in(mask_expr)
        raise AttentionMatchError(f"cannot evaluate the attention mask: operator {exc} (mask ops: {', '.join(ops)})") from None
    m2 = m.reshape(-1, seq, seq) if m.size % (seq * seq) == 0 and m.ndim >= 2 else None
    if m2 is None:
        raise AttentionMatchError(f"the attention mask has shape {m.shape}, not [T, T] with T = {seq}")
    causal = np.tril(np.ones((seq, seq), dtype=bool))
    for one in m2:
        if kind == "additive":
            ok = np.all(one[causal] == 0) and np.all(np.isneginf(one[~causal]) | (one[~causal] < -1e4))
        elif kind == "bool":  # boolean keep-mask
            ok = np.array_equal(one.astype(bool), causal)
        else:  # boolean masked-out mask
            ok = np.array_equal(~one.astype(bool), causal)
        if not ok:
            raise AttentionMatchError("the attention mask is not causal (lower-triangular); "
                                      "only causal self-attention can be rewritten to a block cache")


def _match_softmax_site(graph: Graph, sm_var, index: int) -> AttentionSite:
    sm = graph.producer[sm_var]
    axis = int(sm.attrs.axis)
    if axis not in (-1, len(shape_of(sm_var)) - 1):
        raise AttentionMatchError(f"softmax {sm_var.name} is not over the last axis")
    # score side: softmax input ← [add mask | where(mask)] ← [scale] ← reshape ← matmul
    cur = sm.args[0]
    mask_seen = False
    post_scale = 1.0
    ops = []
    while True:
        val = graph.producer.get(cur)
        name = op_name(val)
        if name == "relax.matmul":
            mm1 = val
            break
        if name == "relax.add":
            a, b = val.args
            if not graph.depends_on_params(b) or is_const(b):
                mask, cur = b, a
            elif not graph.depends_on_params(a) or is_const(a):
                mask, cur = a, b
            else:
                raise AttentionMatchError(f"softmax {sm_var.name}: the score path adds a tensor that depends on the "
                                          "inputs (an attention bias / input mask), which is not supported")
            T = shape_of(cur)[-1]
            _mask_is_causal(graph, mask, T, "additive")
            mask_seen = True
            ops.append(name)
            continue
        if name == "relax.where":
            cond, x, y = val.args
            ys, xs = _scalar_of(graph.const_of(y)), _scalar_of(graph.const_of(x))
            if ys is not None and ys < -1e4:  # where(keep, scores, -inf)
                _mask_is_causal(graph, cond, shape_of(cur)[-1], "bool")
            elif xs is not None and xs < -1e4:  # where(masked, -inf, scores) — masked_fill
                _mask_is_causal(graph, cond, shape_of(cur)[-1], "bool_inv")
                x = y
            else:
                raise AttentionMatchError(f"softmax {sm_var.name}: a where() on the score path that is not a mask")
            mask_seen = True
            cur = x
            ops.append(name)
            continue
        if name in ("relax.reshape", "relax.broadcast_to"):
            cur = val.args[0]
            ops.append(name)
            continue
        if name in SCALE_OPS and _scalar_of(val.args[1]) is not None:
            s = _scalar_of(val.args[1])
            post_scale *= s if name == "relax.multiply" else 1.0 / s
            cur = val.args[0]
            ops.append(name)
            continue
        found = name or type(val).__name__ if val is not None else f"input '{getattr(cur, 'name', cur)}'"
        raise AttentionMatchError(f"softmax {sm_var.name}: the score path reaches {found}, expected a matmul of "
                                  "queries and keys (optionally scaled and masked)")
    if not mask_seen:
        raise AttentionMatchError(f"softmax {sm_var.name}: attention without a causal mask (bidirectional); only "
                                  "causal self-attention can be rewritten to a block cache")
    # probability side: the matmul whose lhs comes from this softmax
    mm2_var = None
    for var in graph.order:
        val = graph.producer[var]
        if op_name(val) != "relax.matmul":
            continue
        cur = val.args[0]
        while isinstance(cur, relax.Var) and cur is not sm_var and not cur.same_as(sm_var):
            pv = graph.producer.get(cur)
            n = op_name(pv)
            if n in ("relax.reshape", "relax.broadcast_to", "relax.astype"):
                cur = pv.args[0]
            elif n == "relax.where":  # all-masked-row guard: where(row_all_masked, 0, p)
                cur = pv.args[2]
            else:
                break
        if isinstance(cur, relax.Var) and cur.same_as(sm_var):
            mm2_var = var
            break
    if mm2_var is None:
        users = [op_name(graph.producer[u]) for u in graph.users.get(sm_var, [])]
        raise AttentionMatchError(f"softmax {sm_var.name}: its output does not reach a matmul with the values "
                                  f"(its users: {', '.join(str(u) for u in users) or 'none'})")
    mm2 = graph.producer[mm2_var]
    lhs_q, rhs_k = mm1.args
    qs, ks = shape_of(lhs_q), shape_of(rhs_k)
    if qs is None or ks is None or len(qs) < 2 or len(ks) < 2:
        raise AttentionMatchError(f"softmax {sm_var.name}: score matmul operands have unknown shapes")
    T, D = qs[-2], qs[-1]
    Hq = int(np.prod(qs)) // (T * D)
    q_root, sq = _pick_root(graph, lhs_q, LAYOUT_OPS | SCALE_OPS, T, D, Hq,
                            lambda x, G: x, f"softmax {sm_var.name} queries", only_heads=Hq)
    k_root, sk = _pick_root(graph, rhs_k, LAYOUT_OPS | SCALE_OPS, T, D, Hq,
                            lambda x, G: np.swapaxes(np.repeat(x, G, axis=1), -1, -2), f"softmax {sm_var.name} keys")
    H = shape_of(k_root)[1]
    v_root, _ = _pick_root(graph, mm2.args[1], LAYOUT_OPS, T, D, Hq,
                           lambda x, G: np.repeat(x, G, axis=1), f"softmax {sm_var.name} values", only_heads=H)
    out_shape = shape_of(mm2_var)
    if out_shape is None or int(np.prod(out_shape)) != Hq * T * D or out_shape[-2:] != (T, D):
        raise AttentionMatchError(f"softmax {sm_var.name}: attention output shape {out_shape} is not [.., Hq, T, d]")
    return AttentionSite(index=index, q=q_root, k=k_root, v=v_root, num_q_heads=Hq, num_kv_heads=H, seq_len=T,
                         head_dim=D, sm_scale=sq * sk * post_scale, output=mm2_var, output_layout="bhtd",
                         form="matmul-softmax-matmul", ops_seen=ops)


def _match_attention_op(graph: Graph, var, index: int) -> AttentionSite:
    val = graph.producer[var]
    at = val.attrs
    causal = getattr(at, "causal_mask", None)
    if len(val.args) > 3 and val.args[3] is not None and not isinstance(val.args[3], relax.Tuple):
        raise AttentionMatchError(f"R.nn.attention {var.name}: an attention bias is not supported")
    if causal is None or str(causal) not in ("TopLeft", "BottomRight"):
        raise AttentionMatchError(f"R.nn.attention {var.name}: causal_mask={causal}; only causal attention is supported")
    q_in, k_in, v_in = val.args[:3]
    qs = shape_of(q_in)
    if qs is None or len(qs) != 4:
        raise AttentionMatchError(f"R.nn.attention {var.name}: queries of shape {qs}, expected [1, T, heads, d]")
    _, T, Hq, D = qs
    perm = lambda x: np.transpose(x, (0, 2, 1, 3))  # noqa: E731  [1, h, T, d] -> [1, T, h, d]
    q_root, _ = _pick_root(graph, q_in, LAYOUT_OPS, T, D, Hq, lambda x, G: perm(x),
                           f"attention {var.name} queries", only_heads=Hq)
    k_root, _ = _pick_root(graph, k_in, LAYOUT_OPS, T, D, Hq, lambda x, G: perm(np.repeat(x, G, axis=1)),
                           f"attention {var.name} keys")
    H = shape_of(k_root)[1]
    v_root, _ = _pick_root(graph, v_in, LAYOUT_OPS, T, D, Hq, lambda x, G: perm(np.repeat(x, G, axis=1)),
                           f"attention {var.name} values", only_heads=H)
    scale = getattr(at, "scale", None)
    scale = float(scale.value) if scale is not None and hasattr(scale, "value") else (
        float(scale) if scale is not None else 1.0 / np.sqrt(D))
    return AttentionSite(index=index, q=q_root, k=k_root, v=v_root, num_q_heads=Hq, num_kv_heads=H, seq_len=T,
                         head_dim=D, sm_scale=scale, output=var, output_layout="bthd", form="R.nn.attention")


def find_attention_sites(func: relax.Function) -> list[AttentionSite]:
    """All attention sites of ``func`` in graph order; raises AttentionMatchError if there are none
    or one cannot be matched."""
    graph = Graph(func)
    sites = []
    for var in graph.order:
        name = op_name(graph.producer[var])
        if name == "relax.nn.softmax":
            sites.append(_match_softmax_site(graph, var, len(sites)))
        elif name == "relax.nn.attention":
            sites.append(_match_attention_op(graph, var, len(sites)))
    if not sites:
        counts: dict[str, int] = {}
        for var in graph.order:
            n = op_name(graph.producer[var])
            if n:
                counts[n] = counts.get(n, 0) + 1
        top = ", ".join(f"{k.removeprefix('relax.')}×{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:12])
        raise AttentionMatchError("no attention site found: the graph has no softmax and no R.nn.attention "
                                  f"(ops found: {top or 'none'})")
    return sites
