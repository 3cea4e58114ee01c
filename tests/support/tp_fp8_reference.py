"""The TP linears' FP8 math as xorl ran it before each column op cast its input on its shard
(xorl/nn/tp_fp8.py): the oracle of tests/multirank/test_tp_fp8.py, kept as it was (main at 236e90a,
xorl/nn/tp_matmul.py with train.fp8 set), so the new path is held to it bit for bit.

Each GEMM quantised its own operands: the gathered input in ``train.dtype`` cast once per column
member (forward x, and x^T for each weight gradient), each ring chunk cast on its own, the weight cast
once per chunk. Same signatures as xorl/nn/tp_matmul.py's column / row functions, so a test can run a
model through them (monkeypatching xorl.nn.tp_linear_ops).
"""

from __future__ import annotations

import contextlib
import functools

from xorl.nn.tp_comm import (
    all_gather_sequence,
    all_reduce_async,
    reduce_scatter_sequence,
    ring_all_gather,
    ring_reduce_scatter,
    wait_all,
)
from xorl.nn.tp_matmul import bias_grad, column_chunked, row_chunked
from xorl_kernels.fp8.linear import linear_dgrad, linear_forward, linear_wgrad


def _rows(t):
    return t.reshape(-1, t.shape[-1])


def _linear(fp8, a, w, b=None):
    y = linear_forward(_rows(a), w, fp8).view(*a.shape[:-1], w.shape[0])
    return y if b is None else y.add_(b)


def _dgrad(fp8, g, w):
    return linear_dgrad(_rows(g), w, fp8).view(*g.shape[:-1], w.shape[1])


def _wgrad(acc, g, x, fp8):
    partial = linear_wgrad(_rows(g), _rows(x), fp8)
    return partial if acc is None else acc.add_(partial)


def column_forward(cfg, x, weights, biases):
    tp, stats = cfg.tp, cfg.stats
    if not cfg.sequence_sharded:
        return [_linear(cfg.fp8, x, w, b) for w, b in zip(weights, biases)]
    shard = x.shape[-2]
    if not column_chunked(cfg, x):
        gathered = all_gather_sequence(x, tp, stats)
        return [_linear(cfg.fp8, gathered, w, b) for w, b in zip(weights, biases)]
    outs = [x.new_empty(*x.shape[:-2], shard * tp.size, w.shape[0]) for w in weights]

    def consume(chunk, src):
        for out, w, b in zip(outs, weights, biases):
            out.narrow(-2, src * shard, shard).copy_(_linear(cfg.fp8, chunk, w, b))

    ring_all_gather(x, tp, consume, stats)
    return outs


def column_backward(cfg, x, weights, grads, need_dx, need_dw):
    tp, stats = cfg.tp, cfg.stats
    grads = [g.contiguous() for g in grads]
    dws = [None] * len(weights)
    dx = None

    def input_grad(start=0, length=None):
        total = None
        for g, w in zip(grads, weights):
            part = _dgrad(cfg.fp8, g if length is None else g.narrow(-2, start, length), w)
            total = part if total is None else total.add_(part)
        return total

    if cfg.sequence_sharded:
        shard = x.shape[-2]
        if column_chunked(cfg, x):
            if any(need_dw):
                def consume(chunk, src):
                    for j, g in enumerate(grads):
                        if need_dw[j]:
                            dws[j] = _wgrad(dws[j], g.narrow(-2, src * shard, shard), chunk, cfg.fp8)

                ring_all_gather(x, tp, consume, stats)
            if need_dx:
                dx = ring_reduce_scatter(lambda c: input_grad(c * shard, shard), tp, stats)
        else:
            if any(need_dw):
                gathered = all_gather_sequence(x, tp, stats)
                dws = [_wgrad(None, g, gathered, cfg.fp8) if need else None for g, need in zip(grads, need_dw)]
            if need_dx:
                dx = reduce_scatter_sequence(input_grad(), tp, stats)
    else:
        work = None
        if need_dx:
            dx = input_grad()
            if tp.size > 1:
                work = all_reduce_async(dx, tp, stats)
        dws = [_wgrad(None, g, x, cfg.fp8) if need else None for g, need in zip(grads, need_dw)]
        if work is not None:
            wait_all([work], stats, dx.is_cuda)
    return dx, [dw.to(w.dtype) if dw is not None else None for dw, w in zip(dws, weights)]


def row_forward(cfg, x, weight, bias):
    tp, stats = cfg.tp, cfg.stats
    if row_chunked(cfg, x, weight):
        shard = x.shape[-2] // tp.size
        y = ring_reduce_scatter(lambda c: _linear(cfg.fp8, x.narrow(-2, c * shard, shard), weight), tp, stats)
    elif cfg.sequence_sharded:
        y = reduce_scatter_sequence(_linear(cfg.fp8, x, weight), tp, stats)
    else:
        y = _linear(cfg.fp8, x, weight)
        if tp.size > 1:
            wait_all([all_reduce_async(y, tp, stats)], stats, y.is_cuda)
    if bias is not None:
        y += bias
    return y


def row_backward(cfg, x, weight, grad_out, need_dx, need_dw, need_db):
    tp, stats = cfg.tp, cfg.stats
    grad_out = grad_out.contiguous()
    dx = dw = db = None
    bias_work = None
    if need_db:
        db = bias_grad(grad_out)
        if cfg.sequence_sharded:
            bias_work = all_reduce_async(db, tp, stats)
    if cfg.sequence_sharded:
        shard = x.shape[-2] // tp.size
        if row_chunked(cfg, x, weight):
            dx = x.new_empty(x.shape) if need_dx else None

            def consume(chunk, src):
                nonlocal dw
                if need_dx:
                    dx.narrow(-2, src * shard, shard).copy_(_dgrad(cfg.fp8, chunk, weight))
                if need_dw:
                    dw = _wgrad(dw, chunk, x.narrow(-2, src * shard, shard), cfg.fp8)

            ring_all_gather(grad_out, tp, consume, stats)
        else:
            gathered = all_gather_sequence(grad_out, tp, stats)
            dx = _dgrad(cfg.fp8, gathered, weight) if need_dx else None
            dw = _wgrad(None, gathered, x, cfg.fp8) if need_dw else None
    else:
        dx = _dgrad(cfg.fp8, grad_out, weight) if need_dx else None
        dw = _wgrad(None, grad_out, x, cfg.fp8) if need_dw else None
    if bias_work is not None:
        wait_all([bias_work], stats, db.is_cuda)
    return dx, dw.to(weight.dtype) if dw is not None else None, db


@contextlib.contextmanager
def reference_tp_linears():
    """Within: xorl's TP linear ops (xorl/nn/tp_linear_ops.py) run this file's math; restored after."""
    import xorl.nn.tp_linear_ops as ops

    names = ("column_forward", "column_backward", "row_forward", "row_backward")
    saved = {name: getattr(ops, name) for name in names}
    try:
        for name in names:  # the layers without FP8 (lm_head) keep xorl's own
            setattr(ops, name, functools.partial(_fp8_or_own, globals()[name], saved[name]))
        yield
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)


def _fp8_or_own(reference, own, cfg, *args):
    return (own if cfg.fp8 == "none" else reference)(cfg, *args)
