"""Model FLOPs utilisation: achieved training FLOP/s over the GPUs' peak bf16 dense FLOP/s.

FLOPs per token follow the usual 6·N + attention estimate (PaLM appendix B): forward + backward
of every matmul weight touched by a token (for MoE, only the top-k experts it is routed to), plus
12·layers·heads·head_dim·seq_len for the attention scores and values (halved under a causal mask).
With LoRA (``model.lora``) the base weights are frozen: their backward computes the input gradient
only (4·N, no weight-gradient GEMM), and each adapter adds 6·rank·(in + out) for the tokens it sees.
"""

from __future__ import annotations

import os

import torch

# Dense bf16 tensor-core peaks, TFLOP/s, by device-name substring (no sparsity).
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def peak_tflops(device: torch.device) -> float | None:
    """XORL_PEAK_TFLOPS overrides; else a table by device name; None when unknown (or on CPU)."""
    if "XORL_PEAK_TFLOPS" in os.environ:
        return float(os.environ["XORL_PEAK_TFLOPS"])
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16_TFLOPS.items() if k in name), None)


def flops_per_token(model_config, seq_len: int) -> float:
    m = model_config
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    attn = m.hidden_size * head_dim * (2 * m.num_attention_heads + 2 * m.num_key_value_heads)
    head_dim_v = head_dim
    if getattr(m, "kv_lora_rank", 0):  # latent attention (xorl/models/mla.py): low-rank q and kv projections
        h, heads, q_rank = m.hidden_size, m.num_attention_heads, m.q_lora_rank
        head_dim, head_dim_v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        q = h * heads * head_dim if q_rank is None else h * q_rank + q_rank * heads * head_dim
        attn = (q + h * (m.kv_lora_rank + m.qk_rope_head_dim)
                + m.kv_lora_rank * heads * (m.qk_nope_head_dim + head_dim_v) + heads * head_dim_v * h)
    params = m.num_hidden_layers * attn + mlp_params_per_token(m) + m.hidden_size * m.vocab_size  # + lm_head
    # q.k and p.v: 2 (d_qk + d_v) FLOPs per key forward, 3x with the backward; half the keys (causal)
    attention_scores = 6 * m.num_attention_heads * (head_dim + head_dim_v) * keys_per_query(m, seq_len)
    lora = getattr(m, "lora", None)
    if lora:
        return 4 * params + 6 * lora_params_per_token(m, head_dim, head_dim_v) + attention_scores
    return 6 * params + attention_scores


def mlp_params_per_token(m) -> int:
    """MLP weights a token passes through, summed over the layers. An MoE layer: its top-k routed
    experts, the router and the shared expert (with its gate) if any; a dense layer (GLM's and
    DeepSeek's first_k_dense_replace, Qwen-MoE's mlp_only_layers / decoder_sparse_step, every layer
    of a dense model): the full intermediate_size MLP. Which layer is which is the model's own rule
    (ModelSpec.is_moe_layer)."""
    from xorl.models.spec import ModelSpec

    spec = ModelSpec.from_config(m)
    h = spec.hidden_size
    dense = 3 * h * spec.intermediate_size
    moe = 3 * h * spec.moe_intermediate_size * spec.num_experts_per_tok + h * spec.num_experts
    if spec.shared_expert_intermediate_size:
        moe += 3 * h * spec.shared_expert_intermediate_size + (h if spec.family.shared_expert_gate else 0)
    return sum(moe if spec.is_moe_layer(i) else dense for i in range(spec.num_hidden_layers))


def lora_params_per_token(m, head_dim: int, head_dim_v: int) -> int:
    """Adapter weights a token passes through, summed over the layers: rank x (in + out) of each
    targeted projection (xorl/nn/lora.py), the ``experts`` adapters of its top-k experts only."""
    lora = m.lora
    h, heads, kv = m.hidden_size, m.num_attention_heads, m.num_key_value_heads
    widths = {"q_proj": h + heads * head_dim, "k_proj": h + kv * head_dim, "v_proj": h + kv * head_dim_v,
              "o_proj": heads * head_dim_v + h}
    if m.num_experts:
        if "experts" in lora["target_modules"]:  # gate_up [h -> 2I] and down [I -> h] per routed expert
            from xorl.models.spec import ModelSpec  # the experts' width as built (Mixtral's is intermediate_size)

            widths["experts"] = m.num_experts_per_tok * (2 * h + 3 * ModelSpec.from_config(m).moe_intermediate_size)
    else:
        widths.update(gate_proj=h + m.intermediate_size, up_proj=h + m.intermediate_size,
                      down_proj=m.intermediate_size + h)
    per_layer = sum(widths.get(name, 0) for name in lora["target_modules"])
    return m.num_hidden_layers * lora["rank"] * per_layer


def keys_per_query(m, seq_len: int) -> float:
    """Keys a query attends, summed over the layers: seq_len / 2 under full causal attention; a
    sliding window W (gpt-oss's sliding_attention layers, every Mistral layer) sees min(p + 1, W) keys
    at position p, W - W^2 / (2 seq_len) on average."""
    from xorl.models.families import family

    window = getattr(m, "sliding_window", None)
    if window is None:
        return m.num_hidden_layers * seq_len / 2
    types = list(getattr(m, "layer_types", None) or family(m.model_type).default_layer_types(m.num_hidden_layers))
    w = min(window, seq_len)
    return sum(w - w * w / (2 * seq_len) if t == "sliding_attention" else seq_len / 2 for t in types)


def mfu(tokens_per_s: float, model_config, seq_len: int, world_size: int, device: torch.device) -> float | None:
    peak = peak_tflops(device)
    if peak is None:
        return None
    return tokens_per_s * flops_per_token(model_config, seq_len) / (world_size * peak * 1e12)
