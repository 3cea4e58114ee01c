"""``ep_implementation="xorl"``: transformers' expert parallelism with xorl's deduplicated token dispatch.

    from transformers.distributed import DistributedConfig
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="xorl",
        distributed_config=DistributedConfig(fsdp_size=4, ep_size=2, ep_implementation="xorl"))
    # or xorl.hf.distributed_config(path, ep=2), which checks the sizes first (xorl/hf/distributed.py)

transformers 5 shards a MoE model's experts itself: its ``base_model_ep_plan`` puts whole experts on
each rank of the expert-parallel mesh (``grouped_gemm``: ``Shard(0)`` of the 3-D weights) and hands
the experts module's calls to the ``EPImplementation`` that ``DistributedConfig.ep_implementation``
names in its ``EPImplementationInterface`` (``ep_dispatch_experts``). Importing ``xorl.hf`` registers
``"xorl"`` there (xorl/hf/__init__.py): ``XorlExpertParallel`` below, one per experts module, built by
transformers when the plan is applied.

Each call routes this rank's tokens with ``xorl.nn.ep_dispatch.expert_parallel_moe``: one hidden row
per (token, destination rank), not per (token, expert) as transformers' ``all_to_all`` sends them (a
token whose top-k experts share a rank travels there once), the routing weights and local expert ids
beside them; the experts there run as one grouped GEMM per projection on the rows grouped by expert
(xorl/hf/experts.py ``grouped_experts``, the module's local weights, which transformers swaps in
around the call); each pair's slots are summed with their weights, and one row per pair comes back.
Gradients take the reverse exchanges, so every expert's gradient accumulates on its owner and every
token's (routing weights included) on its home rank. transformers' FSDP2 then shards the experts
over their own mesh (``efsdp``, fsdp x tp / ep ranks holding the same experts) and divides their
gradients by the data-parallel size, as it does the dense ones: the gradients of the mean loss of
one process, with HF Trainer's loss scaling or ``loss * dp_size`` with the global token count.

Refused by name: experts not run by xorl's kernels (``experts_implementation`` other than "xorl"),
and TP > 1 together with EP (the ranks of a TP group share one batch; transformers' ``all_to_all``
slices it, this dispatch does not).
"""

from __future__ import annotations

import functools

import torch
from transformers.distributed.expert_parallel import EPImplementation

from xorl.hf.experts import grouped_experts
from xorl.nn.ep_dispatch import expert_parallel_moe

NAME = "xorl"


class XorlExpertParallel(EPImplementation):
    """One experts module's tokens to the ranks holding their experts and back (module docstring)."""

    def __init__(self, experts: torch.nn.Module, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        if tp_mesh.size() > 1:
            raise ValueError(f'ep_implementation="xorl" with tp_size={tp_mesh.size()}: the ranks of a TP group share '
                             "one batch, which xorl's dispatch does not slice; use tp_size=1 with expert parallelism, "
                             'or ep_implementation="all_to_all"')
        self.experts = experts
        self.group = ep_mesh.get_group()
        self.num_experts = self.num_local_experts * ep_mesh.size()

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        implementation = getattr(getattr(self.experts, "config", None), "_experts_implementation", None)
        if implementation != NAME:
            raise ValueError(f'ep_implementation="xorl" runs the experts with xorl\'s grouped GEMM, but this '
                             f'model\'s experts_implementation is {implementation!r}; load it with '
                             'experts_implementation="xorl"')
        return expert_parallel_moe(hidden_states, top_k_index, top_k_weights,
                                   functools.partial(grouped_experts, self.experts), self.num_experts, self.group)
