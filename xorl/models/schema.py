"""The one model schema: every model field declared once, and the families that read it.

Each ``Field`` says its name (the Hugging Face config attribute name), type, default, what kind of
field it is, and which families' config.json carries it (``families``; a family may spell it
differently: ``Family.hf_names``). From this table come:

- ``xorl.config.ModelConfig`` (the YAML ``model:`` section), field for field;
- ``ModelSpec`` (xorl/models/spec.py), the resolved view the modules read;
- ``hf_to_fields`` (a config.json -> field values, refusing what xorl cannot build exactly) and
  ``fields_to_hf`` (the other way, refusing what the family's transformers class cannot hold);
- ``shape_problems``: the shape rules, used by config/validate.py (before launch) and spec.py.

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
        if _plain(values[name]) not in (_plain(value), _plain(FIELD[name].default)):
            problems.append(f"model.{name}={values[name]!r}: model_type={family.model_type!r} always has {value!r}")
        values[name] = value
    for name, source in family.same_as.items():  # never silently replace a value the config set
        if _plain(values[name]) not in (_plain(values[source]), _plain(FIELD[name].default)):
            problems.append(f"model.{name}={values[name]!r}: model_type={family.model_type!r} sizes it as {source} "
                            f"({values[source]!r}); remove model.{name} or set it to {values[source]!r}")
        values[name] = values[source]
    return problems


# ------------------------------------------------------------------------------------------------
# Shape rules (one place: config/validate.py reports them before launch, ModelSpec raises them)
# ------------------------------------------------------------------------------------------------


def shape_problems(m: dict[str, Any], family: Family) -> list[str]:
    """What makes field values ``m`` unbuildable, each naming the field (``model.`` prefixed)."""
    problems = [f"model.{n}={m[n]} must be >= 1" for n in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "decoder_sparse_step", "router_n_group",
        "router_topk_group") if m[n] < 1]
    problems += [f"model.{n}={m[n]} must be >= 0" for n in (
        "num_experts", "shared_expert_intermediate_size", "first_k_dense_replace") if m[n] < 0]
    if m["head_dim"] is not None and m["head_dim"] < 1:
        problems.append(f"model.head_dim={m['head_dim']} must be >= 1, or null for hidden_size // num_attention_heads")
    if problems:
        return problems
    heads, kv = m["num_attention_heads"], m["num_key_value_heads"]
    if heads % kv:
        problems.append(f"model.num_attention_heads={heads} must be a multiple of "
                        f"num_key_value_heads={kv} (grouped-query attention)")
    if m["model_type"] in MLA:
        problems += mla_problems(m)  # head_dim and the rotary dims are MLA's own
    else:
        problems += _head_problems(m)
    for name in ("sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit"):
        if not family.carries(name) and _plain(m[name]) != _plain(FIELD[name].default):
            readers = " or ".join(FIELD[name].families)
            problems.append(f"model.{name}={m[name]!r}: only model_type {readers} reads it; remove it")
    if m["sliding_window"] is not None and m["sliding_window"] < 1:
        problems.append(f"model.sliding_window={m['sliding_window']} must be >= 1 (or null)")
    kinds = ("sliding_attention", "full_attention")
    if m["layer_types"] and (len(m["layer_types"]) != m["num_hidden_layers"]
                             or any(t not in kinds for t in m["layer_types"])):
        problems.append(f"model.layer_types must list one of {kinds} for each of the num_hidden_layers="
                        f"{m['num_hidden_layers']} layers, got {list(m['layer_types'])}")
    elif "sliding_attention" in m["layer_types"] and m["sliding_window"] is None:
        problems.append("model.layer_types has sliding_attention layers but model.sliding_window is null; set it")
    if not family.moe and m["num_experts"] > 0:
        problems.append(f"model.num_experts={m['num_experts']} but model_type={m['model_type']!r} is dense; set "
                        "num_experts: 0, or a mixture-of-experts model_type (qwen3_moe, mixtral, ...)")
    if family.moe:
        e = m["num_experts"]
        if e == 0:
            problems.append(f"model.model_type={m['model_type']!r} needs num_experts >= 1 (or use a dense model_type)")
        elif not 1 <= m["num_experts_per_tok"] <= e:
            problems.append(f"model.num_experts_per_tok={m['num_experts_per_tok']} (top-k) must be between 1 and "
                            f"num_experts={e}")
        if m["moe_intermediate_size"] < 1:
            problems.append(f"model.moe_intermediate_size={m['moe_intermediate_size']} must be >= 1")
        bad = [i for i in m["mlp_only_layers"] if not 0 <= i < m["num_hidden_layers"]]
        if bad:
            problems.append(f"model.mlp_only_layers has {bad}, outside the layer indices "
                            f"0..{m['num_hidden_layers'] - 1}")
        groups, topk_group = m["router_n_group"], m["router_topk_group"]
        if e and groups > 1 and (e % groups or topk_group > groups
                                 or m["num_experts_per_tok"] > topk_group * (e // groups)):
            problems.append(f"model.router_n_group={groups}, router_topk_group={topk_group}: num_experts={e} must "
                            "split into router_n_group equal groups, router_topk_group <= router_n_group, and the "
                            "chosen groups must hold num_experts_per_tok experts")
    return problems + rope_problems(m["rope_scaling"])


def _head_problems(m: dict[str, Any]) -> list[str]:
    """head_dim and partial rotary of plain (grouped-query) attention."""
    problems, heads, head_dim = [], m["num_attention_heads"], m["head_dim"]
    if any(m[n] != FIELD[n].default for n in _MLA_FIELDS):
        problems.append(f"model.{', '.join(n for n in _MLA_FIELDS if m[n] != FIELD[n].default)}: latent attention "
                        f"fields, but model_type={m['model_type']!r} has plain attention; use one of {MLA} or "
                        "remove them")
    if head_dim is None:
        if m["hidden_size"] % heads:
            problems.append(f"model.hidden_size={m['hidden_size']} is not divisible by num_attention_heads={heads}; "
                            "set model.head_dim explicitly or change the sizes")
        head_dim = m["hidden_size"] // heads
    rotary = int(head_dim * m["partial_rotary_factor"])
    if m["partial_rotary_factor"] == 1.0 and head_dim % 2:
        problems.append(f"model: head_dim={head_dim} must be even for RoPE (model.head_dim, or hidden_size / "
                        "num_attention_heads)")
    elif not 0 < m["partial_rotary_factor"] <= 1 or rotary % 2:
        problems.append(f"model.partial_rotary_factor={m['partial_rotary_factor']} must be in (0, 1] and rotate an "
                        f"even number of dims of head_dim={head_dim} (rotates {rotary})")
    return problems


_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_head_dim(m: dict[str, Any]) -> int:
    """MLA's q.k head dim: the no-RoPE and the RoPE part of each head."""
    return m["qk_nope_head_dim"] + m["qk_rope_head_dim"]


# Fields whose null means "derive me from the others" (not "off"): an explicit null sets nothing, so
# with model.model_path the folder's value stands (xorl/config/model_path.py).
DERIVED_WHEN_NULL = frozenset({"head_dim"})


def resolved_head_dim(m: dict[str, Any]) -> int | None:
    """The q.k head dim the model is built with: head_dim when set (under latent attention it must be
    qk_nope + qk_rope: mla_problems); when null, latent attention's qk_nope + qk_rope, else
    hidden_size // num_attention_heads (None while the heads are not set)."""
    if m["head_dim"] is not None:
        return m["head_dim"]
    if m["model_type"] in MLA:
        return mla_head_dim(m)
    return m["hidden_size"] // m["num_attention_heads"] if m["num_attention_heads"] else None


def mla_problems(m: dict[str, Any]) -> list[str]:
    """The latent-attention shape rules (DeepSeek-V2 / V3: xorl/models/mla.py)."""
    problems = [f"model.{n}={m[n]} must be >= 1 for model_type={m['model_type']!r}"
                for n in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if m[n] < 1]
    if m["q_lora_rank"] is not None and m["q_lora_rank"] < 1:
        problems.append(f"model.q_lora_rank={m['q_lora_rank']} must be >= 1, or null for one q_proj")
    if m["qk_rope_head_dim"] % 2:
        problems.append(f"model.qk_rope_head_dim={m['qk_rope_head_dim']} must be even for RoPE")
    if m["head_dim"] is not None and m["head_dim"] != mla_head_dim(m):
        problems.append(f"model.head_dim={m['head_dim']}: {m['model_type']}'s q.k head dim is qk_nope_head_dim + "
                        f"qk_rope_head_dim = {mla_head_dim(m)}; set head_dim to that or null")
    if m["num_key_value_heads"] != m["num_attention_heads"]:
        problems.append(f"model.num_key_value_heads={m['num_key_value_heads']} must equal num_attention_heads="
                        f"{m['num_attention_heads']}: latent attention gives every head its own key and value")
    if m["partial_rotary_factor"] != 1.0:
        problems.append(f"model.partial_rotary_factor={m['partial_rotary_factor']}: latent attention rotates "
                        "qk_rope_head_dim dims of each head; set it to 1.0")
    if m["merge_qkv"]:
        problems.append(f"model.merge_qkv=true: {m['model_type']}'s latent attention has no q/k/v projections to "
                        "merge (its keys and values come from one latent already); set merge_qkv: false")
    return problems


ROPE_TYPES = ("llama3", "linear", "yarn")


def rope_problems(scaling: dict | None) -> list[str]:
    """What makes a RoPE scaling unbuildable (or untrainable), naming model.rope_scaling."""
    if not scaling:
        return []
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "dynamic":
        return ["model.rope_scaling rope_type 'dynamic' is refused: dynamic NTK rescales the frequencies with the "
                "length of the sequence being generated, an inference-time scheme with no fixed positions to train "
                "on; train with plain RoPE, or 'linear' / 'yarn' with a fixed factor"]
    if kind not in ROPE_TYPES:
        return [f"model.rope_scaling rope_type={kind!r} is not supported; use one of {ROPE_TYPES} (or null)"]
    if "factor" not in scaling:
        return [f"model.rope_scaling ({kind}) needs 'factor'"]
    if kind == "llama3" and not {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} <= set(
            scaling):
        return ["model.rope_scaling (llama3) needs low_freq_factor, high_freq_factor and "
                "original_max_position_embeddings"]
    return []


# ------------------------------------------------------------------------------------------------
# config.json <-> field values
# ------------------------------------------------------------------------------------------------


def _rope_from_hf(raw: dict) -> tuple[float | None, dict | None, float | None]:
    """(rope_theta, scaling without theta or None, partial_rotary_factor) from a transformers v4 or
    v5 config.json (v5 keeps all of it in ``rope_parameters``, v4 in rope_theta / rope_scaling)."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = dict(raw.get("rope_scaling") or {})
    theta = raw.get("rope_theta", params.get("rope_theta", legacy.get("rope_theta")))
    partial = raw.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    scaling = {**params, **legacy}  # a v4 rope_scaling next to v5's rope_parameters is the one meant
    for key in ("rope_theta", "partial_rotary_factor"):
        scaling.pop(key, None)
    if "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return theta, scaling, partial


def hf_to_fields(raw: dict, family: Family, where: str) -> tuple[dict[str, Any], list[str]]:
    """(field -> value that config.json ``raw`` defines, problems naming ``where``). Values are not
    coerced to the field types here (xorl/config/model_path.py does that, naming the file)."""
    problems = []
    values: dict[str, Any] = {}
    for f in FIELDS:
        if f.kind == "local" or not family.carries(f.name):
            continue
        for key in family.hf_keys(f.name):
            if raw.get(key) is not None:
                values[f.name] = raw[key]
                break
        else:
            if f.name in family.hf_defaults and not any(key in raw for key in family.hf_keys(f.name)):
                values[f.name] = family.hf_defaults[f.name]
    theta, scaling, partial = _rope_from_hf(raw)
    if theta is None and "rope_theta" in family.hf_defaults:
        theta = family.hf_defaults["rope_theta"]
    if theta is not None:
        values["rope_theta"] = theta
    values["rope_scaling"] = scaling
    problems += [p.replace("model.rope_scaling", "rope_scaling") for p in rope_problems(scaling)]
    if partial is not None and partial != 1.0:
        if not family.carries("partial_rotary_factor"):
            problems.append(f"{where}: partial_rotary_factor={partial}: {family.architecture} rotates whole heads")
        values["partial_rotary_factor"] = partial
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"{where}: hidden_act={raw['hidden_act']!r}; xorl.models use SwiGLU (silu) only")
    if raw.get("mlp_bias"):
        problems.append(f"{where}: mlp_bias=true is not supported by xorl.models")
    if raw.get("attention_dropout"):
        problems.append(f"{where}: attention_dropout={raw['attention_dropout']}; xorl.models have no dropout")
    if raw.get("use_sliding_window"):
        problems.append(f"{where}: use_sliding_window=true: sliding-window attention is not supported yet; "
                        "set it to false")
    elif ("use_sliding_window" not in raw and raw.get("sliding_window") is not None
          and not family.carries("sliding_window")):
        problems.append(f"{where}: sliding_window={raw['sliding_window']}: sliding-window attention is not "
                        "supported yet (it lands with the sliding-window issue); set sliding_window to null")
    for name, value in family.fixed.items():
        key = family.hf_key(name)
        if key in raw and raw[key] != value and raw[key] is not None:
            problems.append(f"{where}: {key}={raw[key]!r}; {family.architecture} always has {value!r}")
        values[name] = value
    if family.read_hf is not None:
        problems += family.read_hf(raw, values)
    return values, [p if p.startswith(where) else f"{where}: {p}" for p in problems]


_MOE_ONLY = {f.name for f in FIELDS if f.families and set(f.families) <= set(MOE)} | {
    "router_scoring", "router_expert_bias", "router_group_score"}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def fields_to_hf(spec: Any, family: Family) -> dict[str, Any]:
    """The config.json dict of ``spec`` that transformers' ``family.architecture`` loads; ValueError
    naming the field when a value cannot be represented there."""
    out: dict[str, Any] = {"architectures": [family.architecture], "model_type": family.model_type}
    for f in FIELDS:
        value = getattr(spec, f.name)
        if f.kind == "local" or f.name in ("model_type", "rope_theta", "rope_scaling", "partial_rotary_factor"):
            continue
        if family.carries(f.name):
            out[family.hf_key(f.name)] = list(value) if isinstance(value, tuple) else value
        elif (f.kind == "arch" and _plain(value) != _plain(family.fixed.get(f.name, f.default))
              and f.name not in family.derived and (family.moe or f.name not in _MOE_ONLY)):
            raise ValueError(f"{f.name}={value!r} has no {family.architecture} equivalent (it always has "
                             f"{family.fixed.get(f.name, f.default)!r}), so this model cannot be exported as one")
    rope = {"rope_type": "default", **(spec.rope_scaling or {}), "rope_theta": spec.rope_theta}
    if spec.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = spec.partial_rotary_factor
    out.update(hidden_act="silu", attention_dropout=0.0, rope_theta=spec.rope_theta, rope_parameters=rope,
               **family.hf_extra)
    if spec.rope_scaling:
        out["rope_scaling"] = {**spec.rope_scaling}  # what transformers v4 reads
    if family.write_hf is not None:
        family.write_hf(spec, out)
    return out
