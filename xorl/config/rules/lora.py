"""The model.lora rules (xorl/nn/lora.py): the adapter's numbers and the modules it may target."""

from __future__ import annotations

from typing import Any

# peft's LoraConfig field -> model.lora key (a user's adapter_config habits, named in the refusal).
PEFT_KEYS = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout"}


def lora_problems(m: Any, t: Any) -> list[str]:
    """model.lora: {rank >= 1, alpha > 0, dropout in [0, 1), target_modules: the family's projections}."""
    lora = m.lora
    if lora is None:
        return []
    from xorl.nn.lora import ALL_LINEAR, EXPERT_LORA_FAMILIES, LINEAR_TARGETS, LORA_KEYS

    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown or "rank" not in lora or "target_modules" not in lora:
        peft_names = [f"{k} -> {PEFT_KEYS[k]}" for k in unknown if k in PEFT_KEYS]
        return [f"model.lora={lora!r}: give rank and target_modules (alpha, dropout, init_lora_weights optional)"
                + (f"; unknown keys {unknown}, the keys are {list(LORA_KEYS)}" if unknown else "")
                + (f" (peft's LoraConfig names: {', '.join(peft_names)})" if peft_names else "")]
    problems = []
    rank, alpha, dropout = lora["rank"], lora.get("alpha", lora["rank"]), lora.get("dropout", 0.0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(f"model.lora.rank={rank!r} must be an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        problems.append(f"model.lora.alpha={alpha!r} must be a number > 0 (the scaling is alpha / rank)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"model.lora.dropout={dropout!r} must be in [0, 1)")
    if not isinstance(lora.get("init_lora_weights", True), bool):
        problems.append("model.lora.init_lora_weights must be true (B = 0, peft's default) or false")
    from xorl.models.schema import MLA

    if m.model_type in MLA:
        return problems + [f"model.lora with model_type={m.model_type!r}: adapters on multi-head latent attention "
                           "(xorl/models/mla.py) are not supported yet; fine-tune it without model.lora"]
    targets = lora["target_modules"]
    valid = list(LINEAR_TARGETS) + (["experts"] if m.num_experts else [])
    if targets in (ALL_LINEAR, [ALL_LINEAR]):  # left by expand_all_linear on an MoE model
        return problems + [f"model.lora.target_modules={targets!r}: peft's 'all-linear' is written out for dense "
                           f"models only; with model_type={m.model_type!r} (an MoE model) list the modules, "
                           f"from {valid} (e.g. [q_proj, k_proj, v_proj, o_proj, experts])"]
    if not isinstance(targets, list) or not targets or not all(isinstance(x, str) for x in targets):
        return problems + [f"model.lora.target_modules={targets!r}: give a non-empty list of module names from "
                           f"{valid}"]
    if "experts" in targets and m.num_experts and m.model_type not in EXPERT_LORA_FAMILIES:
        problems.append(f"model.lora.target_modules: 'experts' with model_type={m.model_type!r}: per-expert adapters "
                        f"are checked against peft for {list(EXPERT_LORA_FAMILIES)} only; target the attention "
                        f"projections {list(LINEAR_TARGETS[:4])}")
    if "experts" in targets and dropout:
        problems.append(f"model.lora.dropout={dropout} with 'experts' targeted: peft's expert adapters take no "
                        "dropout (the delta is applied to the weight); set dropout: 0")
    wrong = [x for x in targets if x not in valid]
    if wrong:
        problems.append(f"model.lora.target_modules: {wrong} are not module names of model_type="
                        f"{m.model_type!r}; the valid names are {valid}")
    merged = [(flag, names) for flag, names in (("merge_qkv", ("q_proj", "k_proj", "v_proj")),
                                               ("merge_gate_up", ("gate_proj", "up_proj")))
              if getattr(m, flag) and set(names) & set(targets)]
    for flag, names in merged:
        problems.append(f"model.lora targets {sorted(set(names) & set(targets))} with model.{flag}=true: peft's "
                        f"adapters are per projection; set {flag}: false")
    dense_layers = m.num_experts == 0 or bool(m.mlp_only_layers) or m.first_k_dense_replace > 0 \
        or m.decoder_sparse_step > 1
    mlp = [x for x in targets if x in ("gate_proj", "up_proj", "down_proj")]
    if mlp and not dense_layers:
        problems.append(f"model.lora.target_modules {mlp}: this MoE model has no dense MLP layer, so they match no "
                        "module; target the attention projections (q_proj, k_proj, v_proj, o_proj)")
    if dropout and t.tensor_parallel_size > 1 and not t.sequence_parallel:
        problems.append(f"model.lora.dropout={dropout} with tensor_parallel_size={t.tensor_parallel_size} and "
                        "sequence_parallel=false: every TP rank would drop the replicated input differently; "
                        "set train.sequence_parallel: true or lora dropout: 0")
    return problems
