"""xorl's kernels inside stock transformers models, through transformers' own extension points.

    import xorl.hf  # registers "xorl"; replaces nothing
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="xorl", experts_implementation="xorl")

Importing this package registers, and does nothing else:

- ``"xorl"`` with transformers' ``AttentionInterface`` (xorl/hf/attention.py: flash attention with
  GQA, MLA head dims, sinks, sliding windows, packed documents, padding masks) and with its
  ``AttentionMaskInterface`` (transformers' flash-attention mask function: the 2-D padding mask or
  None, which the attention reads; without a mask function of its own transformers would hand a
  registered attention no mask at all, and padding would be silently ignored);
- ``"xorl"`` with its ``ExpertsInterface`` (xorl/hf/experts.py: permute, grouped GEMM, SwiGLU,
  unpermute).

- ``"xorl"`` with its ``EPImplementationInterface`` (xorl/hf/expert_parallel.py: xorl's deduplicated
  expert-parallel dispatch, ``DistributedConfig(ep_implementation="xorl")``), and ``"xorl_colwise"`` /
  ``"xorl_rowwise"`` with its ``ParallelInterface`` (xorl/hf/tensor_parallel.py: xorl's TP linears as
  ``tp_plan`` styles). ``xorl.hf.distributed_config(path, tp=..., ep=...)`` (xorl/hf/distributed.py)
  returns the ``DistributedConfig`` naming them, its sizes checked against the model first.

No transformers class or function is replaced: a model uses xorl's kernels only where it is loaded
with those names.

``xorl.hf.apply(model, norm=True, rope=True, mlp=True, loss=True, fp8=None)`` then puts xorl's fused
RMSNorm (with the residual add), RoPE, SwiGLU, fused linear cross-entropy and FP8 linears into that one
loaded model, through transformers' kernel mapping where it marks the module and on the instance
otherwise; ``xorl.hf.remove(model)`` undoes it (xorl/hf/apply.py).
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.distributed.expert_parallel import EPImplementationInterface
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
from transformers.integrations.moe import ExpertsInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from xorl.hf.apply import XorlPatches, apply, remove
from xorl.hf.attention import XorlAttentionError, xorl_attention_forward
from xorl.hf.context_parallel import ContextParallel, count_label_tokens
from xorl.hf.distributed import distributed_config, xorl_tp_plan
from xorl.hf.expert_parallel import XorlExpertParallel
from xorl.hf.experts import xorl_experts_forward
from xorl.hf.layers import XorlApplyError
from xorl.hf.tensor_parallel import COLWISE, ROWWISE, XorlColwiseParallel, XorlRowwiseParallel, XorlTPError

NAME = "xorl"

AttentionInterface.register(NAME, xorl_attention_forward)
AttentionMaskInterface.register(NAME, flash_attention_mask)
ExpertsInterface.register(NAME, xorl_experts_forward)
EPImplementationInterface.register(NAME, XorlExpertParallel)
ALL_PARALLEL_STYLES.register(COLWISE, XorlColwiseParallel())
ALL_PARALLEL_STYLES.register(ROWWISE, XorlRowwiseParallel())

__all__ = ["NAME", "ContextParallel", "XorlApplyError", "XorlAttentionError", "XorlColwiseParallel",
           "XorlExpertParallel", "XorlPatches", "XorlRowwiseParallel", "XorlTPError", "apply",
           "count_label_tokens", "distributed_config", "remove", "xorl_attention_forward",
           "xorl_experts_forward", "xorl_tp_plan"]
