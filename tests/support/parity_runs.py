"""Check functions for the trainer parity matrix: run the real Trainer on every rank of a gloo world.

Module-level so they travel to the ranks by pickle (see xorl/testing/multirank.py).
"""

from __future__ import annotations

import torch.distributed as dist

from xorl.checkpoint.hf_export import full_state_dict
from xorl.config import Config

# Router losses on: balanced over each whole microbatch (its context-parallel shards summed,
# model.router_balance_scope), which every layout computes as one process does.
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            router_aux_loss_coef=0.01)
# Each family's tiny model: what is new in it is on (RoPE scaling with original_max_position_embeddings
# below data.seq_len, partial rotary, biases, a dense first layer, group-limited sigmoid routing).
# LoRA rows: B drawn too (peft's init_lora_weights=false, a test option) so that step 1 already runs
# the adapter forward and backward through both A and B; with B = 0 step 1 would be the base model
# and A's gradient zero. Dropout 0: dropout masks cannot match across layouts.
_LORA = dict(rank=4, alpha=8, dropout=0.0, init_lora_weights=False)
MODELS = {
    "llama": {},
    "llama-tied": dict(tie_word_embeddings=True),  # Llama 3.2 1B / 3B
    "llama-lora": dict(lora=dict(_LORA, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])),
    "qwen3_moe-lora": dict(model_type="qwen3_moe", **_MOE, lora=dict(_LORA, target_modules=["q_proj", "k_proj",
                                                                                            "v_proj", "o_proj"])),
    "qwen3_moe-lora-experts": dict(model_type="qwen3_moe", **_MOE,
                                   lora=dict(_LORA, target_modules=["q_proj", "v_proj", "experts"])),
    "qwen3_moe": dict(model_type="qwen3_moe", **_MOE),
    "llama3.1-rope": dict(model_type="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}),
    "qwen3": dict(model_type="qwen3", attention_bias=True),
    # Mixtral / OLMoE / gpt-oss size their experts as intermediate_size (the tiny model's 64)
    "mixtral": dict(model_type="mixtral", **{**_MOE, "moe_intermediate_size": 64}),
    "olmoe": dict(model_type="olmoe", **{**_MOE, "norm_topk_prob": False, "moe_intermediate_size": 64}),
    "glm4_moe": dict(model_type="glm4_moe", **_MOE, num_hidden_layers=4, first_k_dense_replace=1,
                     shared_expert_intermediate_size=32, router_n_group=2, router_topk_group=1,
                     routed_scaling_factor=2.0, attention_bias=True, partial_rotary_factor=0.5),
    # Latent attention with q_lora_rank, q.k head 8 + 4 against a v head of 6, YaRN (original length
    # below seq_len, mscale_all_dim on the softmax scale), interleaved RoPE, biased sigmoid group routing.
    "deepseek_v3": dict(model_type="deepseek_v3", **_MOE, num_key_value_heads=4, first_k_dense_replace=1,
                        q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                        shared_expert_intermediate_size=32, router_n_group=2, router_topk_group=1,
                        routed_scaling_factor=2.0, rope_scaling={
                            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                            "mscale": 1.0, "mscale_all_dim": 1.0}),
    # The families the matrix reached last (tests/multirank/test_parity_matrix_families.py). Qwen2: biases on
    # q, k, v (fixed by the family) and none on o. Mistral 7B v0.1's kind: every layer one sliding
    # window (8), shorter than the sequence (32) and than a ring shard (16).
    "qwen2": dict(model_type="qwen2"),
    "qwen2-merged": dict(model_type="qwen2", merge_qkv=True, merge_gate_up=True),  # the biases in qkv_proj
    "mistral": dict(model_type="mistral", sliding_window=8),
    # Qwen2-MoE: q/k/v biases (qkv_bias), a shared expert behind sigmoid(shared_expert_gate(x)), a
    # dense layer (mlp_only_layers) before the MoE ones, softmax top-2 not renormalised.
    "qwen2_moe": dict(model_type="qwen2_moe", **{**_MOE, "norm_topk_prob": False}, attention_bias=True,
                      shared_expert_intermediate_size=32, mlp_only_layers=[0]),
    # DeepSeek-V2-Lite's shape: latent attention without q_lora_rank (one q_proj), q.k head 8 + 4
    # against a v head of 6, a dense first layer (first_k_dense_replace), V2's router (softmax, no
    # selection bias, group_limited_greedy: 2 groups ranked by their best score, 1 kept, weights times
    # routed_scaling_factor, never renormalised), an ungated shared expert, YaRN past its original length.
    "deepseek_v2": dict(model_type="deepseek_v2", **{**_MOE, "norm_topk_prob": False}, num_key_value_heads=4,
                        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=6, shared_expert_intermediate_size=32, router_n_group=2,
                        router_topk_group=1, routed_scaling_factor=2.0, rope_scaling={
                            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                            "mscale": 1.0, "mscale_all_dim": 1.0}),
    # Windows (8) shorter than the sequence (32) on the even layers, sinks, q/k/v/o, router and expert
    # biases, a swiglu_limit the tiny model's gates cross, YaRN past original_max_position_embeddings.
    "gpt_oss": dict(model_type="gpt_oss", **{**_MOE, "moe_intermediate_size": 64}, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2, attention_bias=True, swiglu_limit=0.1,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 8}),
}


def tiny_config(output_dir: str, model: str = "llama", **train) -> Config:
    """``model``: a key of MODELS (its model_type and what is new in the family)."""
    config = Config()
    m = config.model
    m.vocab_size, m.hidden_size, m.intermediate_size = 272, 32, 64
    m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads = 4, 4, 2
    for key, value in MODELS[model].items():
        setattr(m, key, value)
    config.data.seq_len = 32
    config.data.micro_batch_size = 1
    t = config.train
    t.max_steps, t.warmup_steps, t.gradient_accumulation_steps = 10, 2, 2
    t.output_dir, t.log_steps, t.save_steps = output_dir, 1, 0
    # Why 3e-3: at 1e-2 these tiny models are chaotic under Adam at some steps (a gradient-norm
    # spike; rarely routed experts' tiny gradients normalised to full-size updates), so fp32 rounding
    # alone moves them. Measured, one process against itself with only the attention kernel swapped
    # (xorl vs sdpa, same maths), 10 steps: at 1e-2 Llama's grad norms differ by 3.2e-5, the MoE's
    # losses by 1.0e-5, grad norms 7.5e-4, weights 1.7e-4; at 3e-3 by 7e-8 (Llama) and 1.9e-7,
    # 8.1e-6, 1.5e-6 (MoE): the matrix's 1e-5 then sits far above rounding and catches real errors.
    t.lr = 3e-3
    for key, value in train.items():
        setattr(t, key, value)
    return config


def train_and_report(config: Config) -> dict:
    """Run the trainer; return losses, grad norms and the full final weights (rank 0)."""
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    results = trainer.train()
    full = full_state_dict(trainer.parts, trainer.state.pp_group)
    if dist.get_rank() != 0:
        return {}
    return {
        "losses": [r.loss for r in results],
        "grad_norms": [r.grad_norm for r in results],
        "router_losses": [r.aux_loss for r in results],
        "weights": {k: v.detach().cpu().clone() for k, v in full.items()},
    }


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def weights_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a)
    den = sum(float(b[k].double().norm() ** 2) for k in b)
    return (num / den) ** 0.5


def train_losses(config: Config, stop_at: int | None = None) -> list[float]:
    """Run the trainer (stopping early after ``stop_at`` steps); return the losses of its steps."""
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    losses = [r.loss for r in trainer.train(stop_at)]
    return losses


def resume_and_report(config: Config) -> dict:
    """Resume (per config.train.resume); return the optimizer's hyperparameters after loading, and
    each step's loss and lr."""
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    groups = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in trainer.optimizers[0].param_groups]
    results = trainer.train()
    return {"groups": groups, "losses": [r.loss for r in results], "lrs": [r.lr for r in results],
            "steps": [r.step for r in results]}


def train_with_nan_at(config: Config, bad_step: int) -> str:
    """Make the loss NaN at ``bad_step``; return the error message the trainer stops with."""
    from xorl.trainer.step import NonFiniteLossError
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)

    def poison_output(module, args, kwargs, out):  # the model computes its own loss_sum (fused or not)
        if trainer.step == bad_step and getattr(out, "loss_sum", None) is not None:
            out.loss_sum = out.loss_sum * float("nan")
        return out

    handle = trainer.model.register_forward_hook(poison_output, with_kwargs=True)
    try:
        trainer.train()
    except NonFiniteLossError as err:
        return str(err)
    finally:
        handle.remove()
    raise AssertionError("the trainer did not stop on a NaN loss")


def train_with_rank_dying(config: Config, dying_rank: int, at_step: int) -> None:
    """Rank ``dying_rank`` exits abruptly at ``at_step``; the others must fail, not hang."""
    import os

    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    while trainer.step < config.train.max_steps:
        if trainer.step == at_step and dist.get_rank() == dying_rank:
            os._exit(17)
        trainer.train_step()


def train_export_and_report(config: Config) -> dict:
    """Run with export_hf; return rank 0's final full weights (for comparing with the export)."""
    from xorl.trainer.trainer import run_training

    results = run_training(config)
    return {"losses": [r.loss for r in results]}


def initial_weights(config: Config) -> dict:
    """The weights a Trainer starts from (after sharding), gathered whole."""
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    full = full_state_dict(trainer.parts, trainer.state.pp_group)  # a collective: every rank calls it
    return full if dist.get_rank() == 0 else {}
