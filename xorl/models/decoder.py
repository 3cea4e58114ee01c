"""The decoder-only causal LM every family builds (xorl/models/registry.py lists them).

Module tree and parameter names mirror transformers (LlamaForCausalLM / Qwen3MoeForCausalLM):
    model.embed_tokens, model.layers[i].{input_layernorm, self_attn, post_attention_layernorm, mlp},
    model.norm, lm_head
so a state dict has the HF names (except stacked MoE experts; hf_reader converts those).

Forward contract
----------------
``model(input_ids, position_ids=None, labels=None, cu_seqlens=None, max_seqlen=None) -> CausalLMOutput``
- input_ids [batch, seq] int64. position_ids [batch, seq] (or [seq]); give them explicitly when the
  sequence is a context-parallel shard or packed (positions restart at 0 per document). If None:
  per-document positions from cu_seqlens, else 0..seq-1.
- cu_seqlens [num_docs + 1] int (packed documents in one row, batch must be 1): attention is
  block-diagonal causal. max_seqlen: longest document (computed from cu_seqlens when None).
- labels [batch, seq], ALREADY ALIGNED with the positions: labels[:, t] is the target of
  logits[:, t] (the data pipeline shifts before packing / sharding); -100 is ignored.

Pipeline-parallel hooks: ``model.embed_tokens``, ``model.norm`` and ``lm_head`` may be set to None
and entries of ``model.layers`` may be set to None (names of the rest stay ``model.layers.{i}``);
without embeddings the first argument is taken as hidden states [batch, seq, hidden], and without
lm_head ``output.logits`` holds the hidden states.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from xorl.models.attention import Attention
from xorl.models.layers import RotaryEmbedding, SwiGLUMLP
from xorl.models.mla import LatentAttention
from xorl.models.spec import ModelSpec
from xorl.nn.cross_entropy import cross_entropy_sum, linear_cross_entropy_sum
from xorl.nn.lora import check_targets_built, freeze_base, lora_spec
from xorl.nn.moe import MoE, MoEAux
from xorl.nn.rms_norm import RMSNorm

IGNORE_INDEX = -100


@dataclass
class CausalLMOutput:
    """What the models return.

    logits            [batch, seq, vocab] (fp of the model's dtype); None when labels were given
                      and the model computes its loss fused (spec.fused_loss: no logits are formed)
    loss              mean cross-entropy over label tokens != -100 (fp32); None without labels.
                      Contains NO router loss.
    loss_sum          the sum of those cross-entropies (fp32; what the trainer divides by the step's
                      label tokens); None without labels
    num_label_tokens  number of label tokens that entered ``loss`` (so loss * num_label_tokens is the sum)
    router_loss       MoE only: sum over this forward's MoE layers of the ``aux.loss`` each block returns
                      = router_aux_loss_coef * load_balancing_loss + router_z_loss_coef * z_loss
                      (already weighted, differentiable: add it to the LM loss); None on dense models
    router_stats      MoE only, detached, one row per MoE layer of this forward:
                      "moe_layers" (layer indices), "load_balancing_loss" [L] (Switch loss,
                      uniform routing = 1; see tests/moe_reference.router_losses), "z_loss" [L],
                      "tokens_per_expert" [L, num_experts] int64
    """

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    num_label_tokens: torch.Tensor | None = None
    router_loss: torch.Tensor | None = None
    router_stats: dict = field(default_factory=dict)


# A pytree node, so torch's tree utilities see the tensors inside. FSDP2 registers its pre-backward
# hook (which all-gathers the root's parameters again: embedding, final norm, lm_head) on the
# grad-requiring tensors of a module's output; torch 2.11 (the GPU image's) finds them with
# tree_flatten, which treats an unregistered dataclass as one leaf, so backward read the freed
# storage of the resharded root parameters (a segfault on CPU). torch 2.13 walks dataclasses itself.
torch.export.register_dataclass(CausalLMOutput)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len] positions restarting at 0 at each document start."""
    positions = torch.arange(seq_len, device=cu_seqlens.device)
    doc_ids = torch.searchsorted(cu_seqlens[1:], positions, right=True)
    return positions - cu_seqlens[doc_ids]


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, mlp: nn.Module, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.self_attn = LatentAttention(spec) if spec.is_mla else Attention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.mlp = mlp

    def forward(self, hidden, cos, sin, cu_seqlens=None, max_seqlen=None, token_mask=None
                ) -> tuple[torch.Tensor, MoEAux | None]:
        """(hidden, the MoE block's auxiliary losses, or None for a dense MLP)."""
        attn_out = self.self_attn(self.input_layernorm(hidden), cos, sin, cu_seqlens, max_seqlen)
        x, hidden = self.post_attention_layernorm(attn_out, residual=hidden)  # fused residual add + norm
        # token_mask (False on padding the context-parallel split added) only matters to an MoE
        # block's routing statistics; a dense MLP is per token anyway.
        if isinstance(self.mlp, MoE):
            out, aux = self.mlp(x, token_mask=token_mask)
            return hidden + out, aux
        return hidden + self.mlp(x), None


class DecoderModel(nn.Module):
    """The ``model.`` part: embeddings, layers, final norm (HF's LlamaModel / Qwen3MoeModel)."""

    def __init__(self, spec: ModelSpec, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        # MLA rotates only its qk_rope_head_dim part, as its own head (transformers' DeepseekV3 sets
        # head_dim = qk_rope_head_dim for the rotary tables), not a fraction of the q.k head.
        rope_head_dim = spec.rotary_dim if spec.is_mla else spec.head_dim
        self.rotary_emb = RotaryEmbedding(rope_head_dim, spec.rope_theta, spec.rope_scaling, spec.rotary_dim,
                                          spec.max_position_embeddings)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, token_mask=None
                ) -> tuple[torch.Tensor, list[tuple[int, MoEAux]]]:
        """(hidden states, [(layer index, its MoE block's auxiliary losses)] for the MoE layers run)."""
        if self.embed_tokens is not None:
            if input_ids.dtype.is_floating_point:
                raise TypeError("input_ids must be integer token ids [batch, seq]")
            hidden = self.embed_tokens(input_ids)
            batch, seq = input_ids.shape[:2]
        else:
            hidden = input_ids  # a later pipeline stage receives hidden states
            batch, seq = hidden.shape[:2]
            if position_ids is not None:
                seq = position_ids.shape[-1]
        # Under sequence parallel ``hidden`` holds this TP rank's shard of the sequence; positions
        # (and the rotary tables) cover the whole sequence, which attention sees after its gather.
        if position_ids is None:
            if cu_seqlens is not None:
                position_ids = positions_from_cu_seqlens(cu_seqlens.to(hidden.device), seq)
            else:
                position_ids = torch.arange(seq, device=hidden.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.shape[-1] != seq or position_ids.shape[0] not in (1, batch):
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}; expected [{batch}, {seq}] or [{seq}]"
            )
        position_ids = position_ids.expand(batch, seq)
        if cu_seqlens is not None and max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        auxes = []
        for idx, layer in enumerate(self.layers):
            if layer is not None:
                hidden, aux = layer(hidden, cos, sin, cu_seqlens, max_seqlen, token_mask)
                if aux is not None:
                    auxes.append((idx, aux))
        if self.norm is not None:
            hidden = self.norm(hidden)
        return hidden, auxes


class DecoderForCausalLM(nn.Module):
    """The causal LM of every family: the spec (and its family's traits) decides each block."""

    def __init__(self, config, fp8: str = "none"):
        super().__init__()
        self.config = config
        # train.fp8 is a compute choice of this build, so it joins the spec here, not the model config.
        self.spec = dataclasses.replace(ModelSpec.from_config(config), fp8=fp8)
        spec = self.spec
        layers = [DecoderLayer(spec, self.build_mlp(spec, i), i) for i in range(spec.num_hidden_layers)]
        self.model = DecoderModel(spec, layers)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_weights()
        if spec.lora:  # LoRA fine-tuning: only the adapters the projections were built with train
            freeze_base(self)
            check_targets_built(self, spec.lora)

    def build_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        """A dense SwiGLU MLP, or on an MoE layer (``spec.is_moe_layer``) the family's MoE block."""
        if not spec.is_moe_layer(layer_idx):
            return SwiGLUMLP(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias,
                             merge_gate_up=spec.merge_gate_up, fp8=spec.fp8, lora=spec.lora)
        return MoE(
            spec.hidden_size,
            spec.num_experts,
            spec.num_experts_per_tok,
            spec.moe_intermediate_size,
            norm_topk_prob=spec.norm_topk_prob,
            scoring=spec.router_scoring,
            expert_bias=spec.router_expert_bias,
            bias_update_rate=spec.router_bias_update_rate,
            n_group=spec.router_n_group,
            topk_group=spec.router_topk_group,
            routed_scaling_factor=spec.routed_scaling_factor,
            group_score=spec.router_group_score,
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
            shared_expert_gate=spec.family.shared_expert_gate,
            aux_loss_coef=spec.router_aux_loss_coef,
            z_loss_coef=spec.router_z_loss_coef,
            fp8=spec.fp8,
            lora=lora_spec(spec.lora, "experts"),
            router_bias=spec.family.router_bias,
            expert_biases=spec.family.expert_biases,
            swiglu_alpha=spec.swiglu_alpha,
            swiglu_limit=spec.swiglu_limit if spec.family.clamped_swiglu else None,
        )

    def tie_weights(self) -> None:
        """lm_head shares the embedding matrix when tie_word_embeddings (re-run after to_empty)."""
        if self.spec.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """normal(0, initializer_range) for linear / embedding / expert weights, zero biases, norms 1.

        The numbers depend on (seed, parameter name) only (xorl/models/seeded_init.py), so the same
        seed gives the same model however it is sharded. Without ``seed`` one is drawn from torch's
        global generator (``torch.manual_seed`` decides it). Works after ``to_empty`` on a model
        built on the meta device, also after the parallel plans have sharded it.
        """
        from xorl.models.seeded_init import seeded_init_

        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        seeded_init_(self, seed, self.spec.initializer_range)
        self.tie_weights()

    def forward(self, input_ids, position_ids=None, labels=None, cu_seqlens=None, max_seqlen=None,
                token_mask=None):
        hidden, auxes = self.model(input_ids, position_ids, cu_seqlens, max_seqlen, token_mask)
        if labels is not None and self.spec.fused_loss and self.lm_head is not None:
            output = CausalLMOutput(logits=None)
            token_loss = linear_cross_entropy_sum(hidden, self.lm_head, labels)  # vocabulary-parallel too (TP)
        else:
            logits = self.lm_head(hidden) if self.lm_head is not None else hidden
            output = CausalLMOutput(logits=logits)
            if labels is not None:
                if labels.shape != logits.shape[:-1]:
                    raise ValueError(
                        f"labels shape {tuple(labels.shape)} must equal [batch, seq]={tuple(logits.shape[:-1])}"
                    )
                token_loss = cross_entropy_sum(logits, labels)  # vocabulary-sharded logits too (TP)
        if labels is not None:
            output.loss_sum = token_loss
            output.num_label_tokens = (labels != IGNORE_INDEX).sum()
            output.loss = token_loss / output.num_label_tokens.clamp(min=1)
        _add_router_losses(output, auxes)
        return output


def _add_router_losses(output: CausalLMOutput, auxes: list[tuple[int, MoEAux]]) -> None:
    """The sum of the router losses the MoE layers returned, and their statistics, one row each."""
    if not auxes:
        return
    output.router_loss = torch.stack([aux.loss for _, aux in auxes]).sum()
    output.router_stats = {"moe_layers": [idx for idx, _ in auxes]}
    for key in ("load_balancing_loss", "z_loss", "tokens_per_expert"):
        output.router_stats[key] = torch.stack([getattr(aux, key) for _, aux in auxes])
