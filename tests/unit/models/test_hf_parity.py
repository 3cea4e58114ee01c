"""xorl.models against transformers: same weights (copied through HF safetensors files) -> same
logits, losses and gradients; packed documents against HF on each document alone; our save ->
transformers from_pretrained; MoE router losses against transformers / a float64 formula.

All fp32 on CPU with HF's eager attention; tiny shapes; weights re-drawn so activations are O(1)
(with initializer_range=0.02 attention would be nearly uniform and hide masking bugs).
"""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from xorl.models import build_model, load_hf_weights, save_hf_weights  # noqa: E402
from xorl.models.decoder import IGNORE_INDEX  # noqa: E402

TOL = 1e-5


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def llama_config(**overrides):
    kwargs = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        rms_norm_eps=1e-5,
        attn_implementation="eager",
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def qwen_config(**overrides):
    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # != hidden/heads: head_dim must be read, not derived
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        router_aux_loss_coef=0.01,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        attn_implementation="eager",
    )
    kwargs.update(overrides)
    return transformers.Qwen3MoeConfig(**kwargs)


def xorl_model_config(hf_config, **overrides):
    """The same model described with xorl.config.ModelConfig's field names (a plain namespace)."""
    c = hf_config
    fields = dict(
        model_type=c.model_type,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_parameters["rope_theta"],
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
        num_experts=getattr(c, "num_experts", 0),
        num_experts_per_tok=getattr(c, "num_experts_per_tok", 2),
        moe_intermediate_size=getattr(c, "moe_intermediate_size", 64),
        norm_topk_prob=getattr(c, "norm_topk_prob", False),
        router_aux_loss_coef=getattr(c, "router_aux_loss_coef", 0.001),
        router_z_loss_coef=0.0,
        router_scoring="softmax",
        shared_expert_intermediate_size=0,
        decoder_sparse_step=getattr(c, "decoder_sparse_step", 1),
        mlp_only_layers=list(getattr(c, "mlp_only_layers", [])),
        merge_qkv=False,
        model_path=None,
        attn_implementation="sdpa",
        initializer_range=c.initializer_range,
    )
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations: weights ~ N(0, 1/fan_in) (fan_in = last dim), norms ~ 1 + N(0, 0.3^2)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if "norm" in name:
            p.copy_(1 + 0.3 * noise)
        elif p.dim() == 1:
            p.copy_(0.3 * noise)
        else:
            p.copy_(noise * p.shape[-1] ** -0.5)


def hf_model(config, seed=0):
    cls = transformers.LlamaForCausalLM if config.model_type == "llama" else transformers.Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomize_(model, seed)
    return model


def ours_from_hf(hf, our_config, tmp_path):
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    ours = build_model(our_config).eval()
    load_hf_weights(ours, str(folder))
    return ours


def aligned_labels(input_ids):
    """HF shifts labels inside its loss; xorl takes them aligned: labels[t] = input_ids[t + 1]."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


CASES = {
    "llama": (llama_config, {}),
    "llama-merge_qkv-xorl_attn": (llama_config, {"merge_qkv": True, "merge_gate_up": True,
                                                 "attn_implementation": "xorl"}),
    "qwen3_moe": (qwen_config, {}),
    "qwen3_moe-merge_qkv": (qwen_config, {"merge_qkv": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_grads_match_transformers(case, tmp_path):
    make_config, overrides = CASES[case]
    hf_config = make_config()
    hf = hf_model(hf_config, seed=1)
    ours = ours_from_hf(hf, xorl_model_config(hf_config, **overrides), tmp_path)

    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, hf_config.vocab_size, (2, 13), generator=gen)
    ref = hf(input_ids=input_ids, labels=input_ids)
    out = ours(input_ids, labels=aligned_labels(input_ids))  # the loss fused from the hidden states
    with torch.no_grad():
        assert rel_err(ours(input_ids).logits, ref.logits) < TOL  # logits: a call without labels
    assert abs(out.loss.item() - ref.loss.item()) < TOL * ref.loss.item()
    assert out.num_label_tokens.item() == 2 * 12

    ref.loss.backward()
    out.loss.backward()
    hf_params, our_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    names = ["model.embed_tokens.weight", "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"]
    if "merge_qkv" not in case:
        names.append("model.layers.1.self_attn.k_proj.weight")
    if hf_config.model_type == "qwen3_moe":
        names += ["model.layers.0.mlp.gate.weight", "model.layers.2.self_attn.q_norm.weight"]
    for name in names:
        assert rel_err(our_params[name].grad, hf_params[name].grad) < TOL, name
    if hf_config.model_type == "qwen3_moe":
        # transformers v5 keeps experts fused as [E, 2I, H]; ours are [E, H, 2I] (gate_up) and [E, I, H] (down).
        hf_gate_up = hf_params["model.layers.2.mlp.experts.gate_up_proj"].grad
        ours_gate_up = our_params["model.layers.2.mlp.experts.gate_up_proj"].grad
        assert rel_err(ours_gate_up, hf_gate_up.transpose(1, 2)) < TOL
        hf_down = hf_params["model.layers.0.mlp.experts.down_proj"].grad
        assert rel_err(our_params["model.layers.0.mlp.experts.down_proj"].grad, hf_down.transpose(1, 2)) < TOL


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_packed_documents_match_each_document_alone(family, tmp_path):
    hf_config = llama_config() if family == "llama" else qwen_config()
    hf = hf_model(hf_config, seed=3)
    ours = ours_from_hf(hf, xorl_model_config(hf_config), tmp_path)
    lengths = [5, 1, 7, 3]
    cu_seqlens = torch.tensor([0, 5, 6, 13, 16])
    gen = torch.Generator().manual_seed(4)
    input_ids = torch.randint(0, hf_config.vocab_size, (1, sum(lengths)), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)

    with torch.no_grad():
        ref = torch.cat(
            [hf(input_ids=input_ids[:, a:b]).logits for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])], dim=1
        )
        out = ours(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=7).logits
        # Positions derived from cu_seqlens when not given.
        derived = ours(input_ids, cu_seqlens=cu_seqlens).logits
        # Without cu_seqlens the documents would see each other: the check can fail.
        unpacked = ours(input_ids, position_ids=position_ids).logits
    assert rel_err(out, ref) < TOL
    assert rel_err(derived, ref) < TOL
    assert rel_err(unpacked, ref) > 1e-2


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_our_save_loads_in_transformers(family, tmp_path):
    # Qwen: MoE on odd layers only (decoder_sparse_step=2), merged qkv split on save.
    hf_config = llama_config() if family == "llama" else qwen_config(decoder_sparse_step=2, mlp_only_layers=[])
    our_config = xorl_model_config(hf_config, merge_qkv=family == "qwen3_moe")
    torch.manual_seed(5)
    ours = build_model(our_config).eval()
    randomize_(ours, seed=5)
    folder = tmp_path / "ours"
    save_hf_weights(ours, str(folder), our_config, max_shard_bytes=20_000)  # several shards
    assert (folder / "model.safetensors.index.json").exists()

    cls = transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen3MoeForCausalLM
    hf = cls.from_pretrained(str(folder), attn_implementation="eager").eval()
    assert hf.config.tie_word_embeddings == hf_config.tie_word_embeddings
    if family == "qwen3_moe":
        assert [hasattr(layer.mlp, "experts") for layer in ours.model.layers] == [False, True, False]
        assert [hasattr(layer.mlp, "experts") for layer in hf.model.layers] == [False, True, False]
    gen = torch.Generator().manual_seed(6)
    input_ids = torch.randint(0, hf_config.vocab_size, (2, 9), generator=gen)
    with torch.no_grad():
        assert rel_err(ours(input_ids).logits, hf(input_ids=input_ids).logits) < TOL


def test_router_losses_match_transformers_and_float64(tmp_path):
    hf_config = qwen_config(norm_topk_prob=False)
    hf = hf_model(hf_config, seed=7)
    our_config = xorl_model_config(hf_config, router_z_loss_coef=0.03)
    ours = ours_from_hf(hf, our_config, tmp_path)
    gen = torch.Generator().manual_seed(8)
    input_ids = torch.randint(0, hf_config.vocab_size, (2, 17), generator=gen)
    with torch.no_grad():
        ref = hf(input_ids=input_ids, output_router_logits=True)
    out = ours(input_ids)
    assert rel_err(out.logits, ref.logits) < TOL

    stats = out.router_stats
    assert stats["moe_layers"] == [0, 2]  # layer 1 is in mlp_only_layers
    num_experts, top_k = hf_config.num_experts, hf_config.num_experts_per_tok
    assert len(ref.router_logits) == 2
    for row, logits in enumerate(ref.router_logits):
        # transformers' loss for one layer is top_k x the Switch loss with counts / (T * top_k).
        hf_lb = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func(
            (logits,), num_experts, top_k
        )
        assert abs(stats["load_balancing_loss"][row].item() - hf_lb.item() / top_k) < 1e-5
        # Independent float64 formulas.
        logits64 = logits.double()
        probs = logits64.softmax(-1)
        counts = torch.zeros(num_experts, dtype=torch.float64)
        chosen = probs.topk(top_k, dim=-1).indices.reshape(-1)
        counts.index_add_(0, chosen, torch.ones(chosen.numel(), dtype=torch.float64))
        lb64 = num_experts * (counts / counts.sum() * probs.mean(0)).sum()
        z64 = torch.logsumexp(logits64, -1).pow(2).mean()
        assert abs(stats["load_balancing_loss"][row].item() - lb64.item()) < 1e-6 * lb64.item()
        assert abs(stats["z_loss"][row].item() - z64.item()) < 1e-5 * z64.item()
        assert torch.equal(stats["tokens_per_expert"][row], counts.long())
    expected = 0.01 * stats["load_balancing_loss"].sum() + 0.03 * stats["z_loss"].sum()
    assert abs(out.router_loss.item() - expected.item()) < 1e-6
    # The aux loss is differentiable through the router.
    out.router_loss.backward()
    assert ours.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_dense_model_has_no_router_outputs():
    ours = build_model(xorl_model_config(llama_config()))
    out = ours(torch.randint(0, 97, (1, 6)))
    assert out.router_loss is None and out.router_stats == {} and out.loss is None


def test_meta_build_then_materialise():
    config = xorl_model_config(llama_config(), initializer_range=0.05)
    with torch.device("meta"):
        model = build_model(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(9)
    model.init_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert abs(p.std().item() - 0.05) < 0.01, name
    moe_config = xorl_model_config(qwen_config())
    with torch.device("meta"):
        moe = build_model(moe_config)
    moe.to_empty(device="cpu")
    moe.init_weights()
    experts = moe.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (6, 32, 48) and experts.down_proj.shape == (6, 24, 32)
    assert abs(experts.down_proj.std().item() - 0.02) < 0.004
    assert torch.isfinite(moe(torch.randint(0, 97, (1, 5))).logits).all()


def test_bad_inputs_raise_clear_errors():
    ours = build_model(xorl_model_config(llama_config()))
    ids = torch.randint(0, 97, (2, 6))
    with pytest.raises(ValueError, match="batch=1"):
        ours(ids, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="end at seq_len=6"):
        ours(ids[:1], cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="position_ids"):
        ours(ids, position_ids=torch.arange(5))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        build_model(xorl_model_config(llama_config(), num_key_value_heads=4))
    with pytest.raises(ValueError, match="model_type"):
        build_model(xorl_model_config(llama_config(), model_type="gpt2"))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        build_model(xorl_model_config(qwen_config(), num_experts_per_tok=7))


@pytest.mark.parametrize("scoring, norm_topk_prob", [("softmax", False), ("sigmoid", True)])
def test_reference_moe_block_matches_float64_formula(scoring, norm_topk_prob):
    """The block alone, including what transformers' Qwen3-MoE lacks (sigmoid scores, shared expert)."""
    from tests.support.moe_reference import ReferenceMoE

    hidden, num_experts, top_k = 16, 5, 2
    block = ReferenceMoE(
        hidden, num_experts, top_k, intermediate_size=8, norm_topk_prob=norm_topk_prob, scoring=scoring,
        aux_loss_coef=0.1, z_loss_coef=0.01, shared_expert_intermediate_size=12,
    )
    randomize_(block, seed=10)
    x = torch.randn(3, 7, hidden, generator=torch.Generator().manual_seed(11))
    out = block(x)

    p = {name: t.detach().double() for name, t in block.named_parameters()}
    xs = x.reshape(-1, hidden).double()
    logits = xs @ p["gate.weight"].t()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    weights, ids = scores.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    ref = torch.zeros_like(xs)
    for t in range(xs.shape[0]):
        for slot in range(top_k):
            e = ids[t, slot]
            h = torch.nn.functional.silu(xs[t] @ p["experts.gate_proj"][e]) * (xs[t] @ p["experts.up_proj"][e])
            ref[t] += weights[t, slot] * (h @ p["experts.down_proj"][e])
    shared = torch.nn.functional.silu(xs @ p["shared_expert.gate_proj.weight"].t()) * (
        xs @ p["shared_expert.up_proj.weight"].t()
    )
    ref += torch.sigmoid(xs @ p["shared_expert_gate.weight"].t()) * (shared @ p["shared_expert.down_proj.weight"].t())
    assert rel_err(out.reshape(-1, hidden), ref) < TOL

    probs = scores / scores.sum(-1, keepdim=True)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts).double()
    lb = num_experts * (counts / ids.numel() * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    assert abs(block.last_stats["load_balancing_loss"].item() - lb.item()) < 1e-6 * lb.item()
    assert abs(block.last_aux_loss.item() - (0.1 * lb + 0.01 * z).item()) < 1e-6 * (0.1 * lb + 0.01 * z).item()
    assert torch.equal(block.last_stats["tokens_per_expert"], counts.long())


@pytest.mark.gpu
def test_cuda_bf16_kernel_attention_matches_torch_attention():
    """On CUDA the default core attention is xorl_kernels.attention.op; compare with the SDPA path."""
    # Dense model: in bf16 a tiny attention difference could flip MoE routing and hide the signal.
    config = xorl_model_config(llama_config(), attn_implementation="xorl")
    torch.manual_seed(12)
    model = build_model(config)
    randomize_(model, seed=12)
    model = model.to("cuda", torch.bfloat16)
    reference = build_model(xorl_model_config(llama_config(), attn_implementation="sdpa"))
    reference.load_state_dict(model.state_dict())
    reference = reference.to("cuda", torch.bfloat16)
    cu_seqlens = torch.tensor([0, 37, 40, 128], device="cuda")
    input_ids = torch.randint(0, 97, (1, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(13))
    with torch.no_grad():
        out = model(input_ids, cu_seqlens=cu_seqlens).logits
        ref = reference(input_ids, cu_seqlens=cu_seqlens).logits
    assert rel_err(out, ref) < 2e-2
