"""An int8 KV cache inside the block-cache pass (``BlockCacheSpec.kv_dtype == "int8"``).

The layer's stored K and V are int8 codes [H, N, d] with float16 scales [H, N, G], the scales
last in ``cache_layout`` (``k_scale``, ``v_scale``). Every kernel a site places — attention,
a policy's score / observe / own kernels, select + compaction — keeps its fp32 signature: the
site works on an fp32 *view* of the layer (``read``: dequantised K/V in place of the codes, the
scales left out, every other field as stored), and ``write`` quantises the compacted K/V back
into the codes and scales in place: a row the step kept moves its codes (found by its position in
a copy of the positions taken before the step), any other row is quantised. Why that is exact,
and the kernels: ``kernels/kv_int8.py``.
"""

from __future__ import annotations

from tvm import relax

from ..kernels.kv_int8 import (build_copy_positions_kernel, build_dequantize_kernel, build_round_trip_kernel,
                              build_store_kernel)

SCALE_FIELDS = ("k_scale", "v_scale")


def read(bb, kernel, site, caches: list, k_blk, v_blk):
    """(the layer's fp32 view: caches with K/V dequantised and the scales dropped, the block's K/V
    as the cache will hold them, the positions before the step — ``write`` takes them back)."""
    H, N, D = site.num_kv_heads, int(caches[0].ty.shape[1]), site.head_dim
    B = int(k_blk.ty.shape[2])
    k_codes, v_codes, k_scale, v_scale = caches[0], caches[1], caches[-2], caches[-1]
    deq = kernel(f"kv_dequantize_h{H}_n{N}_d{D}", lambda: build_dequantize_kernel(H, N, D))
    trip = kernel(f"kv_round_trip_h{H}_b{B}_d{D}", lambda: build_round_trip_kernel(H, B, D))
    i = site.index
    k = bb.emit(relax.call_tir(deq, [k_codes, k_scale], relax.TensorType((H, N, D), "float32")), f"k_dequantized_{i}")
    v = bb.emit(relax.call_tir(deq, [v_codes, v_scale], relax.TensorType((H, N, D), "float32")), f"v_dequantized_{i}")
    blocks = []
    for x, name in ((k_blk, "k"), (v_blk, "v")):  # [1, H, B, d] as the kernel's [H, B, d] (a view)
        rows = bb.emit(relax.op.reshape(x, (H, B, D)))
        held = bb.emit(relax.call_tir(trip, [rows], relax.TensorType((H, B, D), "float32")))
        blocks.append(bb.emit(relax.op.reshape(held, (1, H, B, D)), f"{name}_blk_int8_{i}"))
    copy = kernel(f"kv_copy_positions_h{H}_n{N}", lambda: build_copy_positions_kernel(H, N))
    before = bb.emit(relax.call_tir(copy, [caches[2]], caches[2].ty), f"pos_before_{i}")
    return [k, v] + list(caches[2:-2]), blocks[0], blocks[1], before


def write(bb, kernel, site, new_view: list, caches: list, pos_before) -> list:
    """The layer's stored tensors after the step: the view's compacted K/V stored in place into the
    codes and scales (``kernels.kv_int8.build_store_kernel``), every other field as the view has it."""
    H, N, D = site.num_kv_heads, int(caches[0].ty.shape[1]), site.head_dim
    store = kernel(f"kv_store_h{H}_n{N}_d{D}", lambda: build_store_kernel(H, N, D))
    pos, fill = new_view[2], new_view[3]
    stored = []
    for x, codes, scales, name in ((new_view[0], caches[0], caches[-2], "k"), (new_view[1], caches[1], caches[-1], "v")):
        upd = bb.emit(relax.call_tir_inplace(store, [x, pos, fill, pos_before, codes, scales], [4, 5],
                                             [codes.ty, scales.ty]), f"{name}_stored_{site.index}")
        stored.append((bb.emit(relax.TupleGetItem(upd, 0)), bb.emit(relax.TupleGetItem(upd, 1))))
    (kq, ks), (vq, vs) = stored
    return [kq, vq] + list(new_view[2:]) + [ks, vs]
