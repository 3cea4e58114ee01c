"""The tensor-parallel layout of the decoder every family builds (xorl/models/decoder.py), as data:
module path -> TP style (the styles: xorl/nn/tp_styles.py; the one function that walks the layout:
xorl/parallel/tensor_parallel.py ``apply_tensor_parallel``). In the spirit of torchtitan's
``parallelize_module`` plan and transformers' ``base_model_tp_plan``.

One layout for the shared decoder, not one per family: the families build the same module tree, and
what they differ in shows either as modules present or absent, or as one of two traits of the spec
that keep the module names:

* present or absent (a path the model does not have is skipped, so the tables list every form):
  latent attention (DeepSeek: ``q_a_proj`` ... ``kv_b_proj``, ``rope_key_to_heads``) instead of q/k/v;
  ``merge_qkv`` / ``merge_gate_up`` (one ``qkv_proj`` / ``gate_up_proj``); gpt-oss's ``sinks`` (a
  parameter of ``self_attn``, which the ``heads`` style splits); under pipelining the layers, ends and
  norms another stage holds.
* the q/k norm (``spec.qk_norm``): per head (Qwen3) or over the whole width (OLMoE), both ``q_norm``.
* dense or MoE per layer (``spec.is_moe_layer``), both ``mlp``: an MoE block routes this rank's
  token shard (its experts go to expert parallelism), a dense MLP is split by intermediate units.

A tied lm_head needs no entry: it shares the embedding's parameter, and the lm_head's style finds it
placed already (the embedding comes first).

Why these splits: attention by whole heads (the column q/k/v, or the one qkv_proj whose rows come in
KV-head groups, and the row o_proj), the MLP by intermediate units (column gate/up, row down), so each
block needs one reduction (reduce-scatter under sequence parallelism) in forward. The vocabulary ends
are split by vocabulary when it divides by TP; the SP region runs from the embedding's output to the
lm_head's input.
"""

from __future__ import annotations

from dataclasses import dataclass

# Per decoder layer, relative to model.layers.{i}. Order matters only where one style reads another's
# result: ``self_attn`` (its head counts checked) before its projections.
ATTENTION = {
    "input_layernorm": "replicated",
    "self_attn": "heads",
    # grouped-query attention (attention.py): separate projections, or with merge_qkv the one qkv_proj
    "self_attn.q_proj": "column",  # also latent attention's, without q_lora_rank
    "self_attn.k_proj": "column",
    "self_attn.v_proj": "column",
    "self_attn.qkv_proj": "column",
    # latent attention (mla.py): the per-head up-projections split, the low-rank down-projections and
    # their norms whole, the one RoPE key all heads share entering their region
    "self_attn.q_a_proj": "replicated",
    "self_attn.q_a_layernorm": "replicated",
    "self_attn.q_b_proj": "column",
    "self_attn.kv_a_proj_with_mqa": "replicated",
    "self_attn.kv_a_layernorm": "replicated",
    "self_attn.kv_b_proj": "column",
    "self_attn.rope_key_to_heads": "enter_heads",
    "self_attn.o_proj": "row",
    "post_attention_layernorm": "replicated",
}
QK_NORM = {
    "none": {},
    "head": {"self_attn.q_norm": "per_head_replicated", "self_attn.k_norm": "per_head_replicated"},
    "width": {"self_attn.q_norm": "width_norm", "self_attn.k_norm": "width_norm"},
}
DENSE_MLP = {
    "mlp.gate_proj": "column",
    "mlp.up_proj": "column",
    "mlp.gate_up_proj": "column",  # merge_gate_up: rows alternate gate and up units, so a split keeps pairs
    "mlp.down_proj": "row",
}
MOE_MLP = {"mlp": "token_shards"}
ENDS = {
    "model.embed_tokens": "vocab_embedding",
    "model.norm": "replicated",
    "lm_head": "vocab_lm_head",
}
# Column layers that read one input: its gather runs once for all (SharedInputColumnGroup); the key is
# the group's name in the TP communication record.
SHARED_INPUTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(frozen=True)
class TPLayout:
    """Full module paths -> style names, in the order they are applied; shared-input groups."""

    styles: dict[str, str]
    shared_inputs: dict[str, tuple[str, ...]]


def decoder_tp_layout(spec) -> TPLayout:
    """The layout of a ``DecoderForCausalLM`` built from ``spec`` (xorl/models/spec.py)."""
    styles, shared = {}, {}
    for i in range(spec.num_hidden_layers):
        mlp = MOE_MLP if spec.is_moe_layer(i) else DENSE_MLP
        for path, style in {**ATTENTION, **QK_NORM[spec.qk_norm], **mlp}.items():
            styles[f"model.layers.{i}.{path}"] = style
        for name, members in SHARED_INPUTS.items():
            shared[f"model.layers.{i}.{name}"] = tuple(f"model.layers.{i}.{m}" for m in members)
    return TPLayout({**styles, **ENDS}, shared)
