"""The one model schema: every model field declared once, and the families that read it.

Each ``Field`` says its name (the Hugging Face config attribute name), type, default, what kind of
field it is, and which families' config.json carries it (``families``; a family may spell it
differently: ``Family.hf_names``). From this table come:

- ``xorl.config.ModelConfig`` (the YAML ``model:`` section), field for field;
- ``ModelSpec`` (xorl/models/spec.py), the resolved view the modules read;
- xorl/models/hf_config.py: ``hf_to_fields`` (a config.json -> field values, refusing what xorl cannot
  build exactly) and ``fields_to_hf`` (the other way, refusing what the family's transformers class
  cannot hold);
- xorl/models/shape_rules.py: ``shape_problems``, the shape rules, used by config/validate.py (before
  launch) and spec.py.

Kinds: ``arch`` (architecture: a model folder defines it; export refuses a value the family's HF
class cannot represent), ``knob`` (training settings: config.json may hold them, the run's
explicit value wins), ``local`` (how xorl runs the model; never in config.json).

A family (its block wiring and HF weight names) is one file in xorl/models/ declaring a ``Family``,
plus its line in xorl/models/families.py. No torch import here: the config is checked before any
process group or model exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

DENSE = ("llama", "qwen2", "qwen3", "mistral")
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "deepseek_v2", "gpt_oss")
MLA = ("deepseek_v3", "deepseek_v2")  # of those, the ones with multi-head latent attention (xorl/models/mla.py)
ALL = DENSE + MOE


@dataclass(frozen=True)
class Field:
    name: str
    type: Any
    default: Any
    kind: Literal["arch", "knob", "local"] = "arch"
    families: tuple[str, ...] = ALL  # whose config.json carries it
    doc: str = ""


def _f(name, tp, default, kind="arch", families=ALL, doc=""):
    return Field(name, tp, default, kind, families, doc)


FIELDS: tuple[Field, ...] = (
    _f("model_type", Literal[ALL], "llama", doc="the family (xorl/models/families.py)"),
    _f("vocab_size", int, 272, doc="272 = 256 bytes + 16 special tokens for the byte tokenizer"),
    _f("hidden_size", int, 64, doc="the width of the residual stream"),
    _f("intermediate_size", int, 128, doc="the dense MLP's width (Mixtral: each expert's)"),
    _f("num_hidden_layers", int, 2, doc="decoder blocks"),
    _f("num_attention_heads", int, 4, doc="query heads"),
    _f("num_key_value_heads", int, 2, doc="key/value heads (fewer than query heads: GQA)"),
    _f("head_dim", int | None, None, doc="None: hidden_size // num_attention_heads"),
    _f("rms_norm_eps", float, 1e-6, doc="the epsilon of every RMSNorm"),
    _f("rope_theta", float, 10000.0, doc="RoPE base frequency"),
    _f("rope_scaling", dict | None, None,
       doc="RoPE scaling: {rope_type: llama3 | linear | yarn, factor, ...} as in transformers' "
           "rope_parameters (without rope_theta); None for plain RoPE"),
    _f("partial_rotary_factor", float, 1.0, families=("glm4_moe",),
       doc="the fraction of each head's dims that RoPE rotates (GLM-4.5: 0.5)"),
    _f("max_position_embeddings", int, 2048, doc="the longest sequence the model is built for (data.seq_len <= this)"),
    _f("tie_word_embeddings", bool, False, doc="the lm_head shares the embedding weight"),
    _f("attention_bias", bool, False, families=("llama", "qwen3", "qwen3_moe", "olmoe", "glm4_moe", "qwen2_moe", *MLA,
                                                "gpt_oss"),
       doc="biases on q/k/v (and o where the family's HF class puts one there: Family.o_proj_bias); MLA: on "
           "q_a_proj, kv_a_proj_with_mqa and o_proj"),
    # Multi-head latent attention (DeepSeek-V2 / V3, Kimi-K2, Moonlight): xorl/models/mla.py.
    _f("q_lora_rank", int | None, None, families=MLA,
       doc="MLA: width of the query latent (q_a_proj -> q_a_layernorm -> q_b_proj); None: one q_proj"),
    _f("kv_lora_rank", int, 0, families=MLA, doc="MLA: width of the key/value latent (kv_a_proj_with_mqa)"),
    _f("qk_nope_head_dim", int, 0, families=MLA, doc="MLA: the per-head query/key dims without RoPE"),
    _f("qk_rope_head_dim", int, 0, families=MLA,
       doc="MLA: the query/key dims with RoPE (the key's are one head shared by all heads)"),
    _f("v_head_dim", int, 0, families=MLA, doc="MLA: the value head dim (head_dim is qk_nope + qk_rope)"),
    _f("rope_interleave", bool, True, families=("deepseek_v3",),
       doc="MLA: RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout) rather than halves"),
    _f("sliding_window", int | None, None, families=("gpt_oss", "mistral"),
       doc="the window W of the layers layer_types marks sliding_attention (Mistral: every layer): a query at "
           "p attends keys p-W < k <= p"),
    _f("layer_types", list[str], [], families=("gpt_oss",),
       doc="per layer 'sliding_attention' or 'full_attention'; [] on gpt_oss: transformers' default "
           "(even layers sliding, odd full)"),
    # MoE
    _f("num_experts", int, 0, families=MOE, doc="0 on dense models"),
    _f("num_experts_per_tok", int, 2, families=MOE, doc="experts each token is routed to (top-k)"),
    _f("moe_intermediate_size", int, 64, families=("qwen3_moe", "qwen2_moe", "glm4_moe", *MLA),
       doc="each routed expert's MLP width"),
    _f("norm_topk_prob", bool, False, families=("qwen3_moe", "qwen2_moe", "olmoe", "glm4_moe", "deepseek_v3"),
       doc="renormalise the top-k router weights to sum to 1"),
    _f("router_scoring", Literal["softmax", "sigmoid"], "softmax", families=(),
       doc="router scores: softmax over experts, or per-expert sigmoid (DeepSeek-V3, GLM-4.5)"),
    _f("router_expert_bias", bool, False, families=(),
       doc="DeepSeek-V3's auxiliary-loss-free balancing bias (gate.e_score_correction_bias)"),
    _f("router_n_group", int, 1, families=("glm4_moe", *MLA), doc="expert groups of group-limited routing"),
    _f("router_topk_group", int, 1, families=("glm4_moe", *MLA), doc="groups a token may route into"),
    _f("router_group_score", Literal["top2_sum", "max"], "top2_sum", families=(),
       doc="how group-limited routing ranks a group: the sum of its two best scores (DeepSeek-V3, GLM-4.5) "
           "or its best score (DeepSeek-V2's group_limited_greedy)"),
    _f("routed_scaling_factor", float, 1.0, families=("glm4_moe", *MLA), doc="multiplies the routed experts' weights"),
    _f("shared_expert_intermediate_size", int, 0, families=("qwen2_moe",), doc="0: no shared expert"),
    _f("first_k_dense_replace", int, 0, families=("glm4_moe", *MLA), doc="the first k layers use a dense MLP"),
    _f("decoder_sparse_step", int, 1, families=("qwen3_moe", "qwen2_moe"), doc="every n-th block is MoE"),
    _f("mlp_only_layers", list[int], [], families=("qwen3_moe", "qwen2_moe"),
       doc="blocks (0-based) with a dense MLP instead of experts"),
    _f("swiglu_alpha", float, 1.702, families=("gpt_oss",), doc="gpt-oss experts: glu = gate * sigmoid(alpha * gate)"),
    _f("swiglu_limit", float, 7.0, families=("gpt_oss",),
       doc="gpt-oss experts: gate clamped above at the limit, up to [-limit, limit]"),
    # Training knobs: config.json may hold them; an explicit YAML / CLI value wins.
    _f("router_aux_loss_coef", float, 0.001, "knob", families=MOE,
       doc="weight of each MoE layer's Switch load-balancing loss (1 when even), summed over the layers "
       "(Megatron's convention; transformers' pooled loss is top-k times larger: README)"),
    _f("router_z_loss_coef", float, 0.0, "knob", families=(), doc="weight of the router z-loss (0: off)"),
    _f("router_balance_scope", Literal["microbatch", "global_batch"], "microbatch", "knob", families=(),
       doc="tokens the balancing statistics cover: the microbatch (what one process computes, on every "
           "layout) or the global batch (every data- and context-parallel rank's microbatch of the round)"),
    _f("router_bias_update_rate", float, 1e-3, "knob", families=(),
       doc="router_expert_bias moves by this x sign(mean load - load) after every optimizer step"),
    _f("initializer_range", float, 0.02, "knob", doc="std of the seeded initialisation (without model_path)"),
    # Local: how xorl runs the model.
    _f("merge_qkv", bool, False, "local", (),
       doc="one fused q/k/v projection (rows grouped by KV head): one GEMM per TP rank"),
    _f("merge_gate_up", bool, False, "local", (), doc="one fused gate/up projection of the dense MLP"),
    _f("model_path", str | None, None, "local", (), doc="a local HF folder: config.json + *.safetensors"),
    _f("attn_implementation", Literal["xorl", "flash_attn", "sdpa"], "xorl", "local", (),
       doc="xorl (our kernels), flash_attn (the package), or torch sdpa"),
    _f("lora", dict | None, None, "local", (),
       doc="LoRA adapters {rank, alpha, dropout, target_modules[, init_lora_weights]} (xorl/nn/lora.py): the "
           "base model frozen, the adapters trained and saved in peft's format; null: full fine-tuning"),
    _f("fused_loss", bool, True, "local", (),
       doc="the training loss straight from the last hidden states, chunk by chunk over tokens, never holding "
           "the [tokens, vocab] logits (xorl_kernels/fused_linear_ce); false: logits, then the loss"),
)
FIELD = {f.name: f for f in FIELDS}
LOCAL_FIELDS = tuple(f.name for f in FIELDS if f.kind == "local")
TRAINING_KNOBS = tuple(f.name for f in FIELDS if f.kind == "knob")


@dataclass(frozen=True)
class Family:
    """What a family's HF class hard-codes or names differently; declared in its file."""

    model_type: str
    architecture: str  # transformers' class name, written to config.json "architectures"
    moe: bool = False
    qk_norm: Literal["none", "head", "width"] = "none"  # RMSNorm of q/k per head, or over the whole width
    o_proj_bias: bool | None = None  # None: o_proj has a bias when attention_bias; False: never
    shared_expert_gate: bool = True  # a shared expert's output goes through sigmoid(shared_expert_gate(x))
    # field -> its config.json key, or keys (the first is written; any is read)
    hf_names: dict[str, str | tuple[str, ...]] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)  # values the HF class hard-codes
    # field -> what transformers' config class takes when config.json leaves its key out (where that
    # differs from the schema default), so a missing key means the same model in xorl as in transformers
    hf_defaults: dict[str, Any] = field(default_factory=dict)
    # (raw config.json, the fields read so far) -> problems; may fill derived fields in place.
    read_hf: Callable[[dict, dict], list[str]] | None = None
    # (spec, the config.json dict so far) -> None; adds the family's own entries.
    write_hf: Callable[[Any, dict], None] | None = None
    hf_extra: dict[str, Any] = field(default_factory=dict)  # constant config.json entries on export
    # (xorl name fragment, HF name fragment) pairs: how the HF files spell the weights.
    weight_names: tuple[tuple[str, str], ...] = ()
    ignore_extra_layers: bool = False  # HF files hold layers past num_hidden_layers (GLM's MTP layer)
    derived: tuple[str, ...] = ()  # fields read_hf computes from others (not exported under their name)
    # field -> the field whose value it always takes (Mixtral's / OLMoE's experts are intermediate_size wide)
    same_as: dict[str, str] = field(default_factory=dict)
    # gpt-oss's traits: a learned per-head logit joining every softmax row (``self_attn.sinks``), a
    # bias on the router logits, per-expert biases and the clamped SwiGLU (swiglu_alpha / _limit),
    # and HF files holding stacked [E, in, out] experts with gate / up columns interleaved (bf16 or
    # MXFP4 blocks and scales; xorl/models/mxfp4.py).
    attention_sinks: bool = False
    router_bias: bool = False
    expert_biases: bool = False
    clamped_swiglu: bool = False
    experts_interleaved: bool = False
    # With sliding_window set and layer_types empty, which layers slide: transformers' MistralAttention
    # gives every layer the window; gpt-oss's config default alternates (even layers sliding).
    every_layer_slides: bool = False

    def default_layer_types(self, num_layers: int) -> tuple[str, ...]:
        """The layers' attention kinds when ``layer_types`` is empty (and a window is set)."""
        if self.every_layer_slides:
            return ("sliding_attention",) * num_layers
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))

    def carries(self, name: str) -> bool:
        return self.model_type in FIELD[name].families

    def hf_keys(self, name: str) -> tuple[str, ...]:
        keys = self.hf_names.get(name, name)
        return (keys,) if isinstance(keys, str) else keys

    def hf_key(self, name: str) -> str:
        return self.hf_keys(name)[0]


def model_config_class() -> type:
    """``xorl.config.ModelConfig``: one dataclass field per schema field."""
    fields = []
    for f in FIELDS:
        default = f.default
        spec = field(default_factory=lambda d=default: list(d)) if isinstance(default, list) else field(default=default)
        fields.append((f.name, f.type, spec))
    cls = dataclasses.make_dataclass("ModelConfig", fields)
    cls.__module__ = "xorl.config"
    cls.__doc__ = "The ``model:`` section; its fields are declared in xorl/models/schema.py (FIELDS)."
    return cls


def field_values(config: Any) -> dict[str, Any]:
    """Every schema field of ``config`` (a ModelConfig or any object with those attribute names);
    absent or None attributes take the default (head_dim and rope_scaling keep None)."""
    values = {}
    for f in FIELDS:
        value = getattr(config, f.name, None)
        values[f.name] = f.default if value is None else value
    return values


def apply_family(values: dict[str, Any], family: Family) -> list[str]:
    """Set what ``family``'s HF class hard-codes (``fixed``, ``same_as``) in ``values``; a problem for
    each field explicitly set (not its default) to another value."""
    problems = []
    for name, value in family.fixed.items():
        if plain_value(values[name]) not in (plain_value(value), plain_value(FIELD[name].default)):
            problems.append(f"model.{name}={values[name]!r}: model_type={family.model_type!r} always has {value!r}")
        values[name] = value
    for name, source in family.same_as.items():  # never silently replace a value the config set
        if plain_value(values[name]) not in (plain_value(values[source]), plain_value(FIELD[name].default)):
            problems.append(f"model.{name}={values[name]!r}: model_type={family.model_type!r} sizes it as {source} "
                            f"({values[source]!r}); remove model.{name} or set it to {values[source]!r}")
        values[name] = values[source]
    return problems


def plain_value(value: Any) -> Any:
    """A value as config files write it (a tuple as a list), for comparing values across sources."""
    return list(value) if isinstance(value, tuple) else value
