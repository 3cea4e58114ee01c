"""The TP linears as dispatcher ops: ``xorl::tp_column_linear`` and ``xorl::tp_row_linear``.

Why custom ops rather than autograd Functions: selective activation checkpointing
(xorl/parallel/data_parallel.py) decides op by op, under autograd, which outputs a block keeps. An
autograd Function's forward is a string of ops to it: the ring path's per-chunk ``mm(out=)`` /
``addmm(out=)`` and the plain c10d collectives are none of the ops it keeps, so the recompute in
backward ran the column layers' GEMMs and all-gathers again, and the row layers' reduce-scatter /
all-reduce, to rebuild what the cache already held or what nothing used. As one op each, a column
layer's forward (all-gather + its GEMMs, ring or plain, fp8 or not) and a row layer's (GEMM +
reduce-scatter / all-reduce) is kept whole: the row layer keeps its reduced output ([t/P, h] under
sequence parallel), and the recompute runs neither its matmuls nor its collectives. The backward
is an op too, so a traced block holds both whole (train.compile: tests/multirank/test_compile_layouts.py; with
train.fp8 the FP8 GEMMs run inside, per ring chunk: tests/multirank/test_compile_fp8.py). The math is
xorl/nn/tp_matmul.py's, once.

A ProcessGroup (and the layer's communication record) cannot be an op argument: the op takes the
key of a ``TPMatmulConfig`` registered here (weakly: a dropped layer drops its entry).

* Eager: the layer's own config, registered each time the layer calls the op (so a copied model's
  layers find their own), and its communication goes to the layer's own record (overlap_report).
* Under torch.compile (train.compile): the config's compiled twin (``with_compiled_twin``), one per
  TP group and settings, made and registered when the layer is BUILT. Dynamo then neither mutates
  a Python registry while it traces (refused inside an activation-checkpoint region, a graph break
  outside one) nor specialises a graph on a per-layer key: every block of a model shares one
  graph, where a per-layer key recompiled each block and hit dynamo's recompile limit past 8. The
  communication of compiled blocks is recorded under the twin's key, all layers together.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.utils.flop_counter import register_flop_formula

from xorl.nn.tp_matmul import TPMatmulConfig, bias_grad, column_backward, column_forward, row_backward, row_forward
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES

_CONFIGS: weakref.WeakValueDictionary[str, TPMatmulConfig] = weakref.WeakValueDictionary()


def with_compiled_twin(cfg: TPMatmulConfig) -> TPMatmulConfig:
    """``cfg``, holding (``cfg.compiled``) the registered config its layer's ops take in a compiled
    block: shared by every layer of the same TP group and settings. Call it when the layer is built."""
    settings = (cfg.tp.group.group_name, cfg.sequence_parallel, cfg.overlap, cfg.overlap_min_numel, cfg.fp8)
    key = "compiled tp_linear " + "/".join(map(str, settings))
    twin = _CONFIGS.get(key)
    if twin is None or twin.tp.group is not cfg.tp.group:  # a new group may reuse a destroyed one's name
        twin = _CONFIGS[key] = dataclasses.replace(cfg, name=key, compiled=None)
    cfg.compiled = twin  # the layers keep it alive; the registry holds it weakly
    return cfg


def _key(cfg: TPMatmulConfig) -> str:
    if torch.compiler.is_compiling():
        # Read, never written, while dynamo traces: registered at construction (with_compiled_twin).
        if cfg.compiled is None:
            raise RuntimeError(f"TP linear {cfg.name!r} under torch.compile: its config was built without "
                               "xorl.nn.tp_linear_ops.with_compiled_twin")
        return cfg.compiled.name
    key = f"{cfg.name}@{id(cfg):x}"
    _CONFIGS[key] = cfg
    return key


def _config(key: str) -> TPMatmulConfig:
    cfg = _CONFIGS.get(key)
    if cfg is None:
        raise RuntimeError(f"TP linear op: no live TPMatmulConfig {key!r} (its layer was freed?)")
    return cfg


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t  # an op returns no None: empty for "not needed"


def _tokens(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


# -- column: (all-gather ->) GEMMs, one or several weights sharing the input -----------------------

SELECTIVE_CHECKPOINT_SAVES.join("xorl::tp_column_linear", matmuls=lambda x, weights, *_: len(weights))


def _per_member(biases, has_bias: list[bool]) -> list[torch.Tensor | None]:
    """The present biases (an op's list input holds tensors only) spread over the members."""
    present = iter(biases)
    return [next(present) if has else None for has in has_bias]


@torch.library.custom_op("xorl::tp_column_linear", mutates_args=())
def _column_op(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], has_bias: list[bool],
               config: str) -> list[torch.Tensor]:
    outs = column_forward(_config(config), x, weights, _per_member(biases, has_bias))
    return [out.contiguous() for out in outs]


@_column_op.register_fake
def _(x, weights, biases, has_bias, config):
    cfg = _config(config)
    seq = x.shape[-2] * (cfg.tp.size if cfg.sequence_sharded else 1)
    return [x.new_empty(*x.shape[:-2], seq, w.shape[0]) for w in weights]


@torch.library.custom_op("xorl::tp_column_linear_backward", mutates_args=())
def _column_backward_op(grads: list[torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor],
                        needs: list[bool], config: str) -> list[torch.Tensor]:
    """[dx, dW_0, ...]; ``needs`` = [dx, dW_0, ...]; an empty tensor for each one not needed."""
    dx, dws = column_backward(_config(config), x, weights, grads, needs[0], needs[1:])
    return [_or_empty(dx, x)] + [_or_empty(dw, w) for dw, w in zip(dws, weights)]


@_column_backward_op.register_fake
def _(grads, x, weights, needs, config):
    return [x.new_empty(x.shape if needs[0] else 0)] + [
        w.new_empty(w.shape if need else 0) for w, need in zip(weights, needs[1:])]


def _column_setup(ctx, inputs, output):
    x, weights, biases, has_bias, config = inputs
    ctx.save_for_backward(x, *weights)
    ctx.config, ctx.has_bias = config, has_bias


def _column_backward(ctx, grads):
    x, *weights = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]  # need_b: one per present bias
    grads = [g.contiguous() for g in grads]
    dx, *dws = torch.ops.xorl.tp_column_linear_backward(grads, x, weights, [need_x, *need_w], ctx.config)
    with_bias = [g for g, has in zip(grads, ctx.has_bias) if has]
    dbs = [bias_grad(g) if need else None for g, need in zip(with_bias, need_b)]
    return dx if need_x else None, [dw if need else None for dw, need in zip(dws, need_w)], dbs, None, None


_column_op.register_autograd(_column_backward, setup_context=_column_setup)


def column_parallel_linear(cfg: TPMatmulConfig, x: torch.Tensor, weights, biases) -> list[torch.Tensor]:
    """[gather_seq(x) @ W_j^T + b_j for each j]: the local shards' outputs (xorl/nn/tp_matmul.py)."""
    has_bias = [b is not None for b in biases]
    return torch.ops.xorl.tp_column_linear(x, list(weights), [b for b in biases if b is not None], has_bias,
                                           _key(cfg))


# -- row: GEMM (-> reduce-scatter / all-reduce) ------------------------------------------------------

SELECTIVE_CHECKPOINT_SAVES.join("xorl::tp_row_linear", matmuls=lambda *_: 1)


@torch.library.custom_op("xorl::tp_row_linear", mutates_args=())
def _row_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: str) -> torch.Tensor:
    return row_forward(_config(config), x, weight, bias).contiguous()


@_row_op.register_fake
def _(x, weight, bias, config):
    cfg = _config(config)
    seq = x.shape[-2] // (cfg.tp.size if cfg.sequence_sharded else 1)
    return x.new_empty(*x.shape[:-2], seq, weight.shape[0])


@torch.library.custom_op("xorl::tp_row_linear_backward", mutates_args=())
def _row_backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, needs: list[bool],
                     config: str) -> list[torch.Tensor]:
    """[dx, dW, db]; ``needs`` says which; an empty tensor for each one not needed."""
    dx, dw, db = row_backward(_config(config), x, weight, grad, *needs)
    return [_or_empty(dx, x), _or_empty(dw, weight), _or_empty(db, weight)]


@_row_backward_op.register_fake
def _(grad, x, weight, needs, config):
    return [x.new_empty(x.shape if needs[0] else 0), weight.new_empty(weight.shape if needs[1] else 0),
            weight.new_empty(weight.shape[0] if needs[2] else 0)]


def _row_setup(ctx, inputs, output):
    x, weight, bias, config = inputs
    ctx.save_for_backward(x, weight)
    ctx.config, ctx.has_bias = config, bias is not None


def _row_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
    grads = torch.ops.xorl.tp_row_linear_backward(grad.contiguous(), x, weight, needs, ctx.config)
    return (*(g if need else None for g, need in zip(grads, needs)), None)


_row_op.register_autograd(_row_backward, setup_context=_row_setup)


def row_parallel_linear(cfg: TPMatmulConfig, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """reduce_scatter_seq(x @ W^T) + b under sequence parallel, else all_reduce(x @ W^T) + b."""
    return torch.ops.xorl.tp_row_linear(x, weight, bias, _key(cfg))


# -- FLOPs, so FlopCounterMode (MFU, the checkpointing tests) sees the GEMMs inside the ops --------

@register_flop_formula(torch.ops.xorl.tp_column_linear, get_raw=True)
def _column_flops(x, weights, *args, out_val=None, **kwargs) -> int:
    return sum(2 * _tokens(out) * x.shape[-1] * out.shape[-1] for out in out_val)


@register_flop_formula(torch.ops.xorl.tp_column_linear_backward, get_raw=True)
def _column_backward_flops(grads, x, weights, needs, *args, out_val=None, **kwargs) -> int:
    per_gemm = [2 * _tokens(g) * g.shape[-1] * x.shape[-1] for g in grads]
    return sum(per_gemm) * needs[0] + sum(f for f, need in zip(per_gemm, needs[1:]) if need)


@register_flop_formula(torch.ops.xorl.tp_row_linear, get_raw=True)
def _row_flops(x, weight, *args, out_val=None, **kwargs) -> int:
    return 2 * _tokens(x) * weight.shape[0] * weight.shape[1]


@register_flop_formula(torch.ops.xorl.tp_row_linear_backward, get_raw=True)
def _row_backward_flops(grad, x, weight, needs, *args, out_val=None, **kwargs) -> int:
    return 2 * _tokens(x) * weight.shape[0] * weight.shape[1] * (int(needs[0]) + int(needs[1]))
