"""Activation checkpointing: decoder blocks that recompute in backward what they did not keep.

    apply_activation_checkpointing(model, mode, every_n_layers, selective)   # before FSDP: wraps decoder blocks

``train.activation_checkpointing``: none, full (every n-th block keeps only its input) or selective
(every block keeps the outputs of its attention kernels, expert GEMMs, collectives and, by
``train.selective_checkpoint``, all or every other dense matmul). The custom ops that selective
checkpointing keeps join xorl_kernels/selective_checkpoint_saves.py where they are defined.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn


def checkpointing_mode(setting) -> str:
    """train.activation_checkpointing as none / full / selective (true / false read as full / none)."""
    if setting is True:
        return "full"
    if setting is False:
        return "none"
    return setting


@dataclass
class ActivationCheckpointingRecord:
    """What ``apply_activation_checkpointing`` did."""

    mode: str  # full / selective
    layers: list[int]  # the wrapped decoder blocks' indices


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", every_n_layers: int = 1,
                                   selective: str = "matmuls") -> ActivationCheckpointingRecord:
    """Recompute decoder blocks in backward.

    full: every ``every_n_layers``-th block keeps only its input and recomputes everything.
    selective (torchtitan's op-level policy): every block saves the outputs of its attention
    kernels, expert GEMMs and collectives, and recomputes the cheap element-wise ops between them
    (norms, rotary, SwiGLU's activation and products), which hold most of the activation bytes
    for the fewest FLOPs. Its dense matmuls (mm / addmm: the linears and the router), by
    ``selective`` (train.selective_checkpoint): "matmuls" saves every one (no matmul is
    recomputed); "every_other_matmul" saves the 1st, 3rd, ... in the order the block runs them and
    recomputes the others (torchtitan's ``mm_count % 2``: of q, k, v, o, gate, up, down it
    recomputes k, o and up; under TP o alone, see ``_every_other_matmul_contexts``), trading those
    outputs' bytes for their FLOPs.
    """
    from xorl._torch_compat import checkpoint_wrapper

    kwargs = {}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        if selective == "matmuls":
            policy = functools.partial(_selective_policy, _save_ops())
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
        elif selective == "every_other_matmul":
            kwargs["context_fn"] = functools.partial(_every_other_matmul_contexts, _save_ops())
        else:
            raise ValueError(f"selective checkpoint {selective!r}: use matmuls or every_other_matmul")
    elif mode != "full":
        raise ValueError(f"activation checkpointing mode {mode!r}: use none, full or selective")
    layers = model.model.layers
    blocks = [i for i, layer in enumerate(layers) if layer is not None]
    wrapped = []
    for n, i in enumerate(blocks):
        if mode == "selective" or n % every_n_layers == 0:
            layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False, **kwargs)
            wrapped.append(i)
    return ActivationCheckpointingRecord(mode, wrapped)


def _save_ops() -> set:
    """The ops whose outputs selective checkpointing keeps (those absent from this torch are skipped)."""
    aten, names = torch.ops.aten, []
    names += [(aten, n) for n in ("mm", "addmm", "bmm", "_scaled_mm", "_grouped_mm",
                                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")]
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None:
        names += [(functional, n) for n in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single")]
    # Our custom ops (xorl_kernels, xorl/nn) join xorl_kernels/checkpoint_saves.py where they are
    # defined; an op named there but not registered is an error, not skipped. The modules defining
    # them are imported here so the list does not depend on what the run happened to import first.
    import xorl.nn.ep_dispatch  # noqa: F401
    import xorl.nn.ring_attention  # noqa: F401
    import xorl.nn.tp_linear_ops  # noqa: F401
    import xorl.nn.tp_regions  # noqa: F401
    import xorl.nn.ulysses_attention  # noqa: F401
    import xorl_kernels.attention.op  # noqa: F401
    import xorl_kernels.expert_gemm.op  # noqa: F401
    import xorl_kernels.fp8.grouped  # noqa: F401
    import xorl_kernels.fp8.linear  # noqa: F401
    from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES

    ops = SELECTIVE_CHECKPOINT_SAVES.ops()
    for namespace, name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _selective_policy(save_ops: set, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _every_other_matmul_contexts(save_ops: set):
    """One block call's checkpoint contexts for selective_checkpoint: every_other_matmul.

    Called by the checkpoint for every forward of the block, so the counts start at 0 in each
    block. The forward and the recompute count their own dense matmuls: both see the same ops in
    the same order, so the recompute finds saved exactly the outputs its forward saved.

    A tensor-parallel linear is one op (xorl/nn/tp_linear_ops.py) running one GEMM per weight (q, k
    and v share one): it advances the count by its GEMMs, in the block's order, and is kept when
    any of them falls on a kept position (its outputs are kept or recomputed together). Of a TP
    Llama block's q, k, v | o | gate, up | down it recomputes o alone (torchtitan's k and up ride
    with q/v and gate, kept)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES

    aten = torch.ops.aten
    dense = {aten.mm.default, aten.addmm.default}
    counts = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs):
        matmuls = 1 if op in dense else SELECTIVE_CHECKPOINT_SAVES.dense_matmuls(op, args)
        if matmuls:
            first = counts[ctx.is_recompute] + 1
            counts[ctx.is_recompute] += matmuls
            if all(n % 2 == 0 for n in range(first, first + matmuls)):
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
