"""The data-parallel plan: FSDP2 / HSDP sharding, the DDP gradient sum, and activation checkpointing.

    apply_activation_checkpointing(model, mode, every_n_layers)   # before FSDP: wraps decoder blocks
    apply_fsdp(model, state, reshard_after_forward, bf16_compute, float8_all_gather)  # FSDP2 per block, then the root
    (each returns a record of what it did: CheckpointingRecord, FSDPRecord)
    all_reduce_gradients(params, group)                              # data_parallel_mode: ddp

Gradients are SUMMED across data-parallel ranks (FSDP's divide factor 1, DDP's all-reduce sum):
the loss is already normalised by the global token count (xorl/trainer/loss.py), so averaging again would
scale gradients by 1/dp.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [layer for layer in model.model.layers if layer is not None]


def checkpointing_mode(setting) -> str:
    """train.activation_checkpointing as none / full / selective (true / false read as full / none)."""
    if setting is True:
        return "full"
    if setting is False:
        return "none"
    return setting


@dataclass
class CheckpointingRecord:
    """What ``apply_activation_checkpointing`` did."""

    mode: str  # full / selective
    layers: list[int]  # the wrapped decoder blocks' indices


@dataclass
class FSDPRecord:
    """What ``apply_fsdp`` did: the meshes the parameters are sharded over (FSDP reduces their
    gradients itself, in backward)."""

    mesh: object  # the blocks' and the root's DeviceMesh
    expert_mesh: object | None  # the experts' own mesh, or None when they share the blocks'
    reshard_after_forward: bool
    float8_all_gather: bool = False  # the tensorwise-FP8 linears' weights are gathered in float8


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", every_n_layers: int = 1,
                                   selective: str = "matmuls") -> CheckpointingRecord:
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
    return CheckpointingRecord(mode, wrapped)


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


def apply_fsdp(model: nn.Module, state, reshard_after_forward: bool = True, bf16_compute: bool = False,
               float8_all_gather: bool = False) -> FSDPRecord:
    """FSDP2 per block, then the root; expert weights on their own EP-FSDP mesh (dp_shard x CP x TP / EP).

    HSDP when the FSDP mesh has a replicate dim (data_parallel_replicate_size > 1). Gradients are
    SUMMED across ranks (divide factor 1): the loss is already normalised by the global token count
    (xorl/trainer/loss.py), so averaging again would scale gradients by 1/dp.
    ``float8_all_gather`` (train.fp8_all_gather): the tensorwise-FP8 linears' weights are gathered
    as float8 (xorl/nn/fp8_all_gather.py).
    """
    if float8_all_gather:
        from xorl.nn.fp8_all_gather import cast_weights_for_float8_all_gather

        cast_weights_for_float8_all_gather(model)
    mesh = state.fsdp_mesh
    kw = {"reshard_after_forward": reshard_after_forward}
    if bf16_compute:  # bf16 compute, fp32 master weights and fp32 gradient reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Experts get their own mesh whenever it differs from the blocks': under EP, and under TP, where
    # each TP rank's MoE block routes its own token shard (expert gradients are partial over TP).
    expert_mesh = _expert_fsdp_mesh(state) if experts_have_own_mesh(state) else None
    for layer in decoder_layers(model):
        experts = getattr(getattr(_unwrap(layer), "mlp", None), "experts", None)
        if experts is not None and expert_mesh is not None:
            fully_shard(experts, mesh=expert_mesh, **kw)
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            _sum_gradients(module)
    return FSDPRecord(mesh, expert_mesh, reshard_after_forward, float8_all_gather)


def experts_have_own_mesh(state) -> bool:
    """Expert weights are FSDP-sharded over "ep_fsdp" (dp_shard x CP x TP / EP) unless that is the
    blocks' FSDP mesh (no EP, no TP)."""
    return state.ep_size > 1 or state.tp_size > 1


def _expert_fsdp_mesh(state):
    """Experts are sharded over "ep_fsdp" and, under HSDP, replicated over dp_replicate."""
    if state.dp_replicate_size > 1:
        from xorl._torch_compat import concatenate_meshes

        return concatenate_meshes([state.dp_replicate_mesh, state.ep_fsdp_mesh])
    return state.ep_fsdp_mesh


def _unwrap(layer: nn.Module) -> nn.Module:
    return getattr(layer, "_checkpoint_wrapped_module", layer)


def _sum_gradients(module: FSDPModule) -> None:
    module.set_gradient_divide_factor(1.0)
    # Plain SUM collectives: gloo has no PREMUL_SUM, and NCCL's zero-copy path wants SUM too.
    module.set_force_sum_reduction_for_comms(True)


@torch.no_grad()
def all_reduce_gradients(params, group, bucket_bytes: int = 64 * 2**20) -> None:
    """data_parallel_mode ddp: replicas sum their gradients (same normalisation as FSDP above).

    Why buckets: one all-reduce per parameter would be hundreds of small collectives per step (723
    for a 70B model); gradients are flattened into buckets of up to ``bucket_bytes`` per dtype, one
    all-reduce each, and copied back.
    """
    import torch.distributed as dist

    from xorl._torch_compat import flatten_dense_tensors as _flatten_dense_tensors
    from xorl._torch_compat import unflatten_dense_tensors as _unflatten_dense_tensors

    by_dtype: dict = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for i, grad in enumerate(grads):
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= bucket_bytes or i == len(grads) - 1:
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=group)
                for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    g.copy_(reduced)
                bucket, size = [], 0
