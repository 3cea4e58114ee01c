"""Router against the float64 formulas: top-k choice, weights, both losses and their gradients."""

from __future__ import annotations

import pytest
import torch

from xorl.nn.router import Router


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def reference_router(x, weight, top_k, scoring, norm_topk_prob, bias=None):
    """float64 formulas, written out independently of xorl.nn.router."""
    logits = x.double() @ weight.double().t()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)
    selection = scores if bias is None else scores + bias.double()
    ids = selection.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    num_tokens, num_experts = logits.shape
    counts = torch.zeros(num_experts, dtype=torch.float64)
    for e in ids.flatten().tolist():
        counts[e] += 1
    lb = num_experts * sum(counts[e] / (num_tokens * top_k) * probs[:, e].mean() for e in range(num_experts))
    z = (logits.exp().sum(-1).log() ** 2).mean()
    return w, ids, lb, z, counts


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_float64(scoring, norm_topk_prob):
    torch.manual_seed(0)
    hidden, num_experts, top_k, num_tokens = 24, 10, 3, 57
    router = Router(hidden, num_experts, top_k, scoring=scoring, norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        router.weight.normal_(std=0.5)
    x = torch.randn(num_tokens, hidden, requires_grad=True)
    out = router(x)
    x64 = x.detach().double().requires_grad_()
    w64 = router.weight.detach().double().requires_grad_()
    w_ref, ids_ref, lb_ref, z_ref, counts_ref = reference_router(x64, w64, top_k, scoring, norm_topk_prob)

    assert torch.equal(out.expert_ids, ids_ref)
    assert torch.equal(out.tokens_per_expert, counts_ref.long())
    assert out.weights.dtype == torch.float32 and out.logits.dtype == torch.float32
    assert rel_err(out.weights, w_ref) < 1e-5
    assert rel_err(out.load_balancing_loss, lb_ref) < 1e-5
    assert rel_err(out.z_loss, z_ref) < 1e-5

    # Gradients of a mix of all three outputs, against float64 autograd.
    coef = torch.randn(num_tokens, top_k)
    (out.weights * coef).sum().add(0.7 * out.load_balancing_loss).add(0.3 * out.z_loss).backward()
    ((w_ref * coef.double()).sum() + 0.7 * lb_ref + 0.3 * z_ref).backward()
    assert rel_err(x.grad, x64.grad) < 1e-5
    assert rel_err(router.weight.grad, w64.grad) < 1e-5


def test_load_balancing_loss_is_transformers_over_top_k():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(1)
    router = Router(16, 8, 2)
    out = router(torch.randn(40, 16))
    hf = load_balancing_loss_func((out.logits,), 8, 2)
    assert rel_err(out.load_balancing_loss * 2, hf) < 1e-6


def test_expert_bias_steers_selection_only_and_updates_towards_balance():
    torch.manual_seed(2)
    hidden, num_experts, top_k = 16, 6, 2
    router = Router(hidden, num_experts, top_k, expert_bias=True, bias_update_rate=0.01)
    assert "e_score_correction_bias" in router.state_dict()
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.tensor([5.0, 5.0, 0, 0, 0, 0]))  # force experts 0 and 1
    x = torch.randn(30, hidden)
    out = router(x)
    assert set(out.expert_ids.flatten().tolist()) == {0, 1}
    w_ref, ids_ref, *_ = reference_router(
        x, router.weight.detach(), top_k, "softmax", True, bias=router.e_score_correction_bias
    )
    assert torch.equal(out.expert_ids, ids_ref)
    assert rel_err(out.weights, w_ref) < 1e-5  # weights are the unbiased scores, renormalised

    load = router.update_bias()
    assert load.tolist() == [30, 30, 0, 0, 0, 0]
    expected = torch.tensor([5.0 - 0.01, 5.0 - 0.01, 0.01, 0.01, 0.01, 0.01])
    assert torch.allclose(router.e_score_correction_bias, expected)
    assert router.pending_load().sum() == 0
    router.eval()
    router(x)
    assert router.pending_load().sum() == 0  # no accumulation outside training


def test_no_tokens_gives_zero_losses_not_nan():
    out = Router(8, 4, 2)(torch.randn(0, 8))
    assert out.expert_ids.shape == (0, 2) and out.load_balancing_loss == 0 and out.z_loss == 0


def test_clear_errors():
    with pytest.raises(ValueError, match="top_k must be in"):
        Router(8, 4, 5)
    with pytest.raises(ValueError, match="scoring"):
        Router(8, 4, 2, scoring="relu")
    with pytest.raises(ValueError, match="hidden_size=8"):
        Router(8, 4, 2)(torch.randn(3, 9))
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        Router(8, 4, 2).update_bias()
