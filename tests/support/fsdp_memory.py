"""Exact per-rank accounting of what FSDP2 holds unsharded during a training step.

Walks the FSDP2 parameter groups of every model part (torch internals, read-only: FSDPParam's
unsharded parameter and gradient buffers) and sums the bytes their storages hold at a sampling
point. Sampled at every decoder block's forward (after FSDP's unshard) and at the start of its
backward (a hook on the block's output gradient). Module-level so the check travels by pickle.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule


def _storage_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().nbytes()


def _param_groups(parts):
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    yield module, group


def held_bytes(parts) -> dict[str, int]:
    """Bytes this rank holds now: unsharded params / grads of FSDP groups, sharded grads, blocks unsharded."""
    out = {"unsharded_params": 0, "unsharded_grads": 0, "sharded_grads": 0, "blocks_unsharded": 0,
           "blocks_with_unsharded_grads": 0}
    for _, group in _param_groups(parts):
        params = grads = 0
        for fp in group.fsdp_params:
            if hasattr(fp, "_unsharded_param"):
                params += _storage_bytes(fp._unsharded_param)
                grads += _storage_bytes(fp._unsharded_param.grad)
            grads += _storage_bytes(getattr(fp, "unsharded_accumulated_grad", None))
            grad = fp.sharded_param.grad  # a view into the group's reduce-scatter output: count its own bytes
            if grad is not None:
                out["sharded_grads"] += grad.to_local().numel() * grad.element_size()
        out["unsharded_params"] += params
        out["unsharded_grads"] += grads
        out["blocks_unsharded"] += params > 0
        out["blocks_with_unsharded_grads"] += grads > 0
    return out


def group_bytes(parts) -> dict[str, int]:
    """Full (unsharded) parameter bytes: the largest FSDP group's, the root's, all groups'; and the sharded total."""
    sizes, root = [], 0
    for module, group in _param_groups(parts):
        size = sum(fp._orig_size.numel() * fp.sharded_param.element_size() for fp in group.fsdp_params)
        sizes.append(size)
        if any(module is part for part in parts):
            root += size
    sharded = sum(_storage_bytes(fp.sharded_param) for _, group in _param_groups(parts) for fp in group.fsdp_params)
    return {"largest_group": max(sizes), "all_groups": sum(sizes), "root_group": root, "groups": len(sizes),
            "sharded_params": sharded}


def peak_held_in_step(config, steps: int = 2) -> dict:
    """Train ``steps`` steps; return the peak of ``held_bytes`` over the last step's samples."""
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    for _ in range(steps - 1):
        trainer.train_step()
    peak: dict[str, int] = {}

    def sample(*_):
        for key, value in held_bytes(trainer.parts).items():
            peak[key] = max(peak.get(key, 0), value)

    def on_forward(module, args, output):
        sample()
        output = output[0] if isinstance(output, tuple) else output  # a decoder layer: (hidden, MoE aux)
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(lambda grad: sample())

    hooks = [layer.register_forward_hook(on_forward)
             for part in trainer.parts for layer in part.model.layers if layer is not None]
    trainer.train_step()
    for hook in hooks:
        hook.remove()
    return {"peak": peak, **group_bytes(trainer.parts)}


def held_after_forward(config) -> dict:
    """One training step; what is held unsharded right after the model's forward (before backward)."""
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    trainer.train_step()
    seen: dict = {}

    def after_forward(module, args, output):
        if not seen:
            seen.update(held_bytes(trainer.parts))

    hook = trainer.parts[0].register_forward_hook(after_forward)
    trainer.train_step()
    hook.remove()
    return {"held": seen, **group_bytes(trainer.parts)}


def collectives_per_group(config, steps: int = 2) -> dict:
    """Train ``steps`` steps (after one untimed step) counting FSDP2's reduce-scatters and all-gathers
    per parameter group on this rank: FSDP's own collective calls (``foreach_reduce`` once per group
    whose gradients it reduces, ``foreach_all_gather`` once per gather), wrapped here for the run."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    trainer.train_step()
    names = {}  # an FSDPParam's id -> its group's index
    for index, (_, group) in enumerate(_param_groups(trainer.parts)):
        names.update({id(fp): index for fp in group.fsdp_params})
    counts = {"reduce": [0] * (max(names.values()) + 1), "gather": [0] * (max(names.values()) + 1)}
    originals = param_group.foreach_reduce, param_group.foreach_all_gather

    def counted(kind, original):
        def call(fsdp_params, *args, **kwargs):
            counts[kind][names[id(fsdp_params[0])]] += 1
            return original(fsdp_params, *args, **kwargs)
        return call

    param_group.foreach_reduce = counted("reduce", originals[0])
    param_group.foreach_all_gather = counted("gather", originals[1])
    try:
        for _ in range(steps):
            trainer.train_step()
    finally:
        param_group.foreach_reduce, param_group.foreach_all_gather = originals
    return counts
