"""One call for a stock model's expert, tensor and FSDP2 parallelism on xorl's kernels, checked up front.

    import xorl.hf
    layout = xorl.hf.distributed_config(path, ep=2)          # under torchrun: 4 ranks -> EP 2 x expert-FSDP 2
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="xorl", experts_implementation="xorl",
                                                 distributed_config=layout)
    Trainer(model=model, ...).train()                        # or any loop (docs/hf.md)

It returns transformers' own ``DistributedConfig``; ``from_pretrained`` then builds the meshes, shards
the model on the meta device and has each rank read only its shards, as it does for its own styles:

- ``tp``: the model's ``tp_plan`` with its ``colwise`` / ``rowwise`` linears on xorl's styles
  (``xorl_tp_plan``, xorl/hf/tensor_parallel.py); the embedding, the lm_head and per-head norms keep
  transformers' styles.
- ``ep``: ``ep_implementation="xorl"``, xorl's deduplicated dispatch (xorl/hf/expert_parallel.py) on the
  model's ``base_model_ep_plan``.
- FSDP2 over the data-parallel ranks (``fsdp``, default ``world_size // tp``): transformers' plan,
  ``fully_shard`` on the embedding and each decoder layer, the final norm (and an untied lm_head)
  kept gathered, then the root; under EP the experts first, on their own mesh (the ``fsdp * tp / ep``
  ranks holding the same experts). Gradients are averaged over the data-parallel ranks, dense and
  expert alike, so the loss to back-propagate is HF Trainer's (``num_items_in_batch`` over those
  ranks, times their number); a plain loop does the same (docs/hf.md).

Every size is checked against the model's config before anything is built, each refusal one
``ValueError`` naming the number that does not divide and the fix.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from xorl.hf.tensor_parallel import XORL_STYLES

_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _config(model):
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    return getattr(model, "config", model)


def _model_class(config, model_class):
    if model_class is None:
        from transformers import AutoModelForCausalLM

        model_class = AutoModelForCausalLM
    mapping = getattr(model_class, "_model_mapping", None)
    return mapping[type(config)] if mapping is not None else model_class


def xorl_tp_plan(model, model_class=None) -> dict[str, str]:
    """The rules of the model's ``tp_plan`` whose style is transformers' ``colwise`` / ``rowwise``, named
    xorl's (the override a ``DistributedConfig(tp_plan=...)`` merges into the model's plan; the other
    rules stay transformers'). ``model``: a path, a config or a model; ``model_class``: the class
    ``from_pretrained`` builds (default: ``AutoModelForCausalLM``'s for the config)."""
    config = _config(model)
    cls = _model_class(config, model_class)
    prefix = cls.base_model_prefix
    base = config.get_text_config().base_model_tp_plan or {}
    plan = {f"{prefix}.{key}": style for key, style in base.items()}
    plan.update(getattr(cls, "_tp_plan", None) or {})
    return {key: XORL_STYLES[style] for key, style in plan.items() if style in XORL_STYLES}


def _world_size(world_size: int | None) -> int:
    if world_size is not None:
        return world_size
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _expert_count(text) -> int | None:
    return next((getattr(text, n) for n in _EXPERT_COUNTS if getattr(text, n, None)), None)


def check_layout(config, tp: int, ep: int, fsdp: int, world: int) -> None:
    """The refusals of ``distributed_config`` (module docstring), against a transformers config."""
    pre = f"xorl.hf.distributed_config(tp={tp}, ep={ep}, fsdp={fsdp})"
    if min(tp, ep, fsdp) < 1:
        raise ValueError(f"{pre}: every size must be at least 1")
    if tp * fsdp != world:
        raise ValueError(f"{pre}: tp x fsdp = {tp * fsdp} ranks, but the world has {world}; choose fsdp = "
                         f"world_size / tp (the default)")
    text = config.get_text_config()
    if ep > 1:
        experts = _expert_count(text)
        if experts is None or not text.base_model_ep_plan:
            raise ValueError(f"{pre}: {type(config).__name__} has no experts to split (a dense model); use ep=1")
        if experts % ep:
            raise ValueError(f"{pre}: {experts} experts do not split over {ep} expert-parallel ranks; choose an ep "
                             f"dividing {experts}")
        if tp > 1:
            raise ValueError(f"{pre}: xorl's expert dispatch runs with tp=1 (a TP group shares one batch, which it "
                             "does not slice); use tp=1 with ep > 1")
        if world % ep:
            raise ValueError(f"{pre}: {ep} expert-parallel ranks do not divide the {world} ranks; choose an ep "
                             f"dividing the world size")
    if tp > 1:
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        for what, count in (("attention heads", heads), ("KV heads", kv_heads),
                            ("MLP width (intermediate_size)", getattr(text, "intermediate_size", None) or tp)):
            if count % tp:
                raise ValueError(f"{pre}: {count} {what} do not split over {tp} TP ranks; choose a tp dividing "
                                 f"{count}")


def distributed_config(model, *, tp: int = 1, ep: int = 1, fsdp: int | None = None, world_size: int | None = None,
                       model_class=None, **kwargs):
    """transformers' ``DistributedConfig`` for this layout on xorl's kernels (module docstring).

    ``model``: a path, a config or a model; ``world_size``: default the process group's (or WORLD_SIZE);
    ``kwargs``: further ``DistributedConfig`` fields (``fsdp_mixed_precision``, ``fsdp_cpu_offload``, ...)."""
    from transformers.distributed import DistributedConfig

    config = _config(model)
    world = _world_size(world_size)
    if fsdp is None:
        fsdp = world // max(tp, 1)
    check_layout(config, tp, ep, fsdp, world)
    tp_plan = xorl_tp_plan(config, model_class) if tp > 1 else None
    return DistributedConfig(tp_size=tp, fsdp_size=fsdp, ep_size=ep, tp_plan=tp_plan,
                             ep_implementation="xorl" if ep > 1 else "auto", **kwargs)
