"""Hybrid Ulysses × ring attention, apply_context_parallel on an xorl model, and the transformers
"xorl_cp" attention — all against float64 single-process runs.

The model checks run a tiny Llama on zig-zag-sharded packed documents of uneven lengths (padded by
prepare_context_parallel_batch) and compare the logits of every real token, the loss, and every
parameter gradient (all-reduced over the CP ranks) with one process running the unsharded
documents in float64.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.support.cp_helpers import (
    DOC_LENS,
    FULL_DOCS,
    SendCounter,
    cp_groups,
    rel_err,
    run_case,
    sq_err,
)
from xorl.distributed.zigzag import prepare_context_parallel_batch
from xorl.nn.ulysses_attention import ContextParallelAttention

TOL = 1e-5
MODEL_TOL = 1e-5
CASES = [
    ("causal packed padded GQA", True, 1, "padded", DOC_LENS, 4, 2),
    ("causal batched MQA (KV replicated)", True, 2, "batched", 32, 4, 1),
    ("full packed MHA", False, 1, "packed", FULL_DOCS, 4, 4),
]
DOC_CU = [0, 13, 43, 48]  # the model checks' documents: 13, 30 and 5 tokens


def _hybrid_errors(seed):
    ring, ulysses = cp_groups(2, 2)
    errors = [run_case(ContextParallelAttention(ring, ulysses, causal=c[1]), c, ring, ulysses, seed) for c in CASES]
    # Count traffic on one case: the ring's point-to-point sends and the Ulysses all-to-alls.
    counter = SendCounter()
    with counter.active():
        run_case(ContextParallelAttention(ring, ulysses), CASES[0], ring, ulysses, seed)
    return errors, len(counter.p2p_sends), len(counter.all_to_all)


def test_hybrid_two_by_two_matches_float64_reference(gloo_world):
    results = gloo_world(4).run(_hybrid_errors, 3)
    for c, (name, *_) in enumerate(CASES):
        errs = [rel_err([r[0][c][t] for r in results]) for t in range(4)]
        assert max(errs) < TOL, f"ring 2 × ulysses 2, {name}: rel err out/dq/dk/dv = {errs}"
    for _, p2p, a2a in results:
        assert p2p == 3  # ring of 2: one K+V hop forward; K+V and dK+dV hops backward
        assert a2a == 4  # two all-to-alls forward, two backward


FEATURE_CASES = [
    ("causal packed padded GQA, sinks, window 6, d_v 12", True, 1, "padded", DOC_LENS, 4, 2,
     {"sinks": True, "window": 6, "d_v": 12}),
    ("batched MQA, sinks, window 3 < chunk, d_v 4", True, 2, "batched", 64, 4, 1,
     {"sinks": True, "window": 3, "d_v": 4}),
]  # fmt: skip


def _hybrid_feature_errors(seed):
    ring, ulysses = cp_groups(2, 2)
    return [run_case(ContextParallelAttention(ring, ulysses, causal=c[1]), c, ring, ulysses, seed)
            for c in FEATURE_CASES]  # fmt: skip


def test_hybrid_two_by_two_with_sinks_windows_and_narrow_v_matches_float64_reference(gloo_world):
    results = gloo_world(4).run(_hybrid_feature_errors, 4)
    for c, (name, *_) in enumerate(FEATURE_CASES):
        errs = [rel_err([r[c][t] for r in results]) for t in range(5)]
        assert max(errs) < TOL, f"ring 2 × ulysses 2, {name}: rel err out/dq/dk/dv/dsinks = {errs}"


# ----------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------
def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6,
    )  # fmt: skip


def _tokens_and_shifted_labels():
    """Fresh token ids and, written independently of the CP helpers, next-token labels per document."""
    ids = torch.randint(0, 64, (1, DOC_CU[-1]), generator=torch.Generator().manual_seed(11))
    labels = torch.full_like(ids, -100)
    for s, e in zip(DOC_CU[:-1], DOC_CU[1:]):
        labels[0, s : e - 1] = ids[0, s + 1 : e]
    return ids, labels


def _cp_batch(ids, ring, ulysses):
    batch = prepare_context_parallel_batch(ids, cu_seqlens=DOC_CU, ring=ring, ulysses=ulysses)
    # Which unsharded token each local slot holds (-1: padding).
    where = prepare_context_parallel_batch(
        torch.arange(1, ids.shape[1] + 1)[None], cu_seqlens=DOC_CU, ring=ring, ulysses=ulysses, pad_token_id=0
    ).input_ids[0] - 1  # fmt: skip
    return batch, where


def _global_loss_backward(logits, labels, group):
    """Sum of token losses on this rank / global label count, backward; returns the global loss."""
    loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    count = (labels != -100).sum().float()
    dist.all_reduce(count, group=group)
    (loss_sum / count).backward()
    total = loss_sum.detach().clone()
    dist.all_reduce(total, group=group)
    return float(total / count)


def _compare(model, ref_model, logits, ref_logits, where, loss, ref_loss):
    """Logit pieces of this rank's real tokens, the two losses, and relative errors of every
    parameter gradient (summed over the CP ranks)."""
    real = where >= 0
    logit_err = sq_err(logits[0, real], ref_logits[0, where[real]])
    grad_errs = {}
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref_model.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad_errs[name] = rel_err([sq_err(grad, p_ref.grad)])
    return logit_err, loss, ref_loss, grad_errs


def _xorl_model_check(ring_size, ulysses_size):
    from xorl.models import build_model
    from xorl.parallel.context_parallel import apply_context_parallel

    ring, ulysses = cp_groups(ring_size, ulysses_size)
    torch.manual_seed(0)
    model = build_model(_llama_config())
    ref_model = copy.deepcopy(model).double()
    ids, labels = _tokens_and_shifted_labels()
    ref = ref_model(ids, labels=labels, cu_seqlens=torch.tensor(DOC_CU))
    ref.loss.backward()
    with torch.no_grad():  # with labels the loss is fused (no logits); a call without them gives logits
        ref.logits = ref_model(ids, cu_seqlens=torch.tensor(DOC_CU)).logits

    apply_context_parallel(model, ring, ulysses)
    batch, where = _cp_batch(ids, ring, ulysses)
    out = model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                max_seqlen=batch.max_seqlen)  # fmt: skip
    loss = _global_loss_backward(out.logits, batch.labels, dist.group.WORLD)
    return _compare(model, ref_model, out.logits, ref.logits, where, loss, float(ref.loss.detach()))


def _hf_model_check(ring_size, ulysses_size):
    from transformers import LlamaForCausalLM

    from tests.support.hf_cp_attention import register_xorl_attention

    ring, ulysses = cp_groups(ring_size, ulysses_size)
    name = register_xorl_attention(ring, ulysses)
    torch.manual_seed(0)
    ref_model = LlamaForCausalLM._from_config(_llama_config(), attn_implementation="eager").double()
    model = LlamaForCausalLM._from_config(_llama_config(), attn_implementation=name)
    model.load_state_dict(ref_model.state_dict())
    ids, labels = _tokens_and_shifted_labels()
    # The reference runs each document on its own: no packing logic involved at all.
    ref_logits = torch.cat([ref_model(ids[:, s:e]).logits for s, e in zip(DOC_CU[:-1], DOC_CU[1:])], dim=1)
    ref_loss = F.cross_entropy(ref_logits[0], labels[0], ignore_index=-100)
    ref_loss.backward()

    batch, where = _cp_batch(ids, ring, ulysses)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, cu_seq_lens_q=batch.cu_seqlens,
                   max_length_q=batch.max_seqlen).logits  # fmt: skip
    loss = _global_loss_backward(logits, batch.labels, dist.group.WORLD)
    result = _compare(model, ref_model, logits, ref_logits, where, loss, float(ref_loss.detach()))
    register_xorl_attention(None, None)  # unbind the groups, which the harness destroys after the check
    return result


def _assert_model_parity(results, label):
    logit_err = rel_err([r[0] for r in results])
    assert logit_err < MODEL_TOL, f"{label}: logits rel err {logit_err}"
    for _, loss, ref_loss, grad_errs in results:
        assert abs(loss - ref_loss) <= MODEL_TOL * abs(ref_loss), f"{label}: loss {loss} vs {ref_loss}"
        worst = max(grad_errs, key=grad_errs.get)
        assert grad_errs[worst] < MODEL_TOL, f"{label}: grad of {worst} rel err {grad_errs[worst]}"


def test_apply_context_parallel_on_xorl_llama_matches_single_process(gloo_world):
    _assert_model_parity(gloo_world(4).run(_xorl_model_check, 2, 2), "xorl Llama, ring 2 × ulysses 2")


@pytest.mark.parametrize("ring_size,ulysses_size", [(2, 1), (1, 2)])
def test_transformers_llama_with_xorl_cp_attention_matches_single_process(gloo_world, ring_size, ulysses_size):
    results = gloo_world(2).run(_hf_model_check, ring_size, ulysses_size)
    _assert_model_parity(results, f"HF Llama attn_implementation='xorl_cp', ring {ring_size} × ulysses {ulysses_size}")


def test_apply_context_parallel_needs_core_attention_modules(monkeypatch):
    from xorl.parallel import context_parallel

    monkeypatch.setattr(context_parallel, "_size", lambda group: 1 if group is None else 2)  # no real group
    with pytest.raises(ValueError, match="no module with a `core_attention`"):
        context_parallel.apply_context_parallel(torch.nn.Linear(2, 2), object(), None)
