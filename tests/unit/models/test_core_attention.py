"""The core attention the models call (LocalAttention, and Attention owning its sinks) with
attention sinks, sliding windows and head_dim_v != head_dim_qk, against the float64 plain-torch
reference of tests/support/cp_helpers.py; and a model under ring context parallelism + FSDP2 whose sinks
gradient (summed over the CP ranks by FSDP, as in training) equals one process'."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.support.cp_helpers import reference_attention, rel_err, sq_err
from xorl.models.attention import LocalAttention

TOL = 1e-5
DOCS = [0, 9, 30, 37]  # packed documents of 9, 21 and 7 tokens


def _inputs(seed, hq=4, hkv=2, d=8, d_v=6, total=37):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, total, hq, d, generator=g)
    k = torch.randn(1, total, hkv, d, generator=g)
    v = torch.randn(1, total, hkv, d_v, generator=g)
    do = torch.randn(1, total, hq, d_v, generator=g)
    sinks = torch.randn(hq, generator=g) * 2
    return q, k, v, do, sinks


def _err(out, ref) -> float:
    """Relative error; absolute where the reference is exactly zero (window 1 without sinks: a
    row's only key is itself, so dq and dk are 0)."""
    num, den = sq_err(out, ref)
    return (num / den) ** 0.5 if den else num**0.5


@pytest.mark.parametrize("backend", ["sdpa", "xorl"])
@pytest.mark.parametrize("window", [None, 1, 5, 64])  # 64: larger than every document
@pytest.mark.parametrize("with_sinks", [False, True])
def test_local_attention_sinks_window_and_narrow_v_match_float64(backend, window, with_sinks):
    q, k, v, do, sinks = _inputs(seed=window or 0)
    cu = torch.tensor(DOCS)
    tensors = [q, k, v] + ([sinks] if with_sinks else [])
    ref_tensors = [t.double().requires_grad_() for t in tensors]
    ref = reference_attention(*ref_tensors[:3], cu, True, sinks=ref_tensors[3] if with_sinks else None,
                              window=window)  # fmt: skip
    ref.backward(do.double())
    for t in tensors:
        t.requires_grad_()
    attn = LocalAttention(softmax_scale=q.shape[-1] ** -0.5, backend=backend)
    out = attn(q, k, v, cu_seqlens=cu, sinks=sinks if with_sinks else None, window=window)
    assert out.shape == (1, 37, 4, 6)
    out.backward(do)
    errs = [_err(out, ref)] + [_err(t.grad, r.grad) for t, r in zip(tensors, ref_tensors)]
    assert max(errs) < TOL, f"{backend} window={window} sinks={with_sinks}: out/dq/dk/dv(/dsinks) {errs}"


def test_flash_attn_package_refuses_sinks_and_windows():
    q = torch.randn(1, 8, 2, 8)
    attn = LocalAttention(backend="flash_attn")
    with pytest.raises(ValueError, match="not wired for attention sinks or sliding windows"):
        attn(q, q, q, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="not wired for attention sinks or sliding windows"):
        attn(q, q, q, window=4)
    with pytest.raises(ValueError, match=r"sinks must be \[heads_q\]"):
        LocalAttention(backend="sdpa")(q, q, q, sinks=torch.zeros(3))


# ----------------------------------------------------------------------------------------------
# a model: Attention owns its sinks; ring CP + FSDP2 reduce their gradient like any other
# ----------------------------------------------------------------------------------------------
DOC_CU = [0, 13, 43, 48]  # 13, 30 and 5 tokens
WINDOWS = (3, 24)  # layer 0: smaller than a ring shard's chunk; layer 1: larger than a shard


def _model_with_sinks_and_windows():
    """A tiny xorl Llama whose attention layers own sinks and have sliding windows (set here as
    a family with them sets them in Attention.__init__, e.g. gpt-oss)."""
    from transformers import LlamaConfig

    from xorl.models import build_model

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         rms_norm_eps=1e-6)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(config)
    for layer, window in zip(model.model.layers, WINDOWS):
        layer.self_attn.sinks = torch.nn.Parameter(torch.randn(4) * 2)
        layer.self_attn.window = window
    return model


def _tokens_and_labels():
    ids = torch.randint(0, 64, (1, DOC_CU[-1]), generator=torch.Generator().manual_seed(11))
    labels = torch.full_like(ids, -100)
    for s, e in zip(DOC_CU[:-1], DOC_CU[1:]):
        labels[0, s : e - 1] = ids[0, s + 1 : e]
    return ids, labels


def _fsdp_ring_sinks_check():
    from xorl.distributed import ParallelConfig, init_parallel_state
    from xorl.distributed.zigzag import prepare_context_parallel_batch
    from xorl.parallel.context_parallel import apply_context_parallel
    from xorl.parallel.data_parallel import apply_fsdp

    model = _model_with_sinks_and_windows()
    ref_model = copy.deepcopy(model).double()
    ids, labels = _tokens_and_labels()
    ref = ref_model(ids, cu_seqlens=torch.tensor(DOC_CU)).logits
    F.cross_entropy(ref[0].float(), labels[0], ignore_index=-100, reduction="sum").div(
        (labels != -100).sum()).backward()  # fmt: skip

    state = init_parallel_state(ParallelConfig(ringattn_parallel_size=dist.get_world_size()))
    ring = state.group("ringattn")
    apply_context_parallel(model, ring, None)
    apply_fsdp(model, state)  # FSDP2 over dp_shard_cp, gradients SUMMED (divide factor 1)
    batch = prepare_context_parallel_batch(ids, cu_seqlens=DOC_CU, ring=ring)  # shifts labels per document
    logits = model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                   max_seqlen=batch.max_seqlen).logits  # fmt: skip
    count = (labels != -100).sum()
    F.cross_entropy(logits[0].float(), batch.labels[0], ignore_index=-100, reduction="sum").div(count).backward()
    errors = {}
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref_model.named_parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errors[name] = rel_err([sq_err(grad, p_ref.grad)])
    return errors


def test_ring_fsdp_model_sinks_gradient_equals_one_process(gloo_world):
    """No all-reduce in the test: the sinks' gradient is summed over the CP ranks by FSDP (as in
    training), and with every other parameter's equals the float64 single-process gradient."""
    for errors in gloo_world(2).run(_fsdp_ring_sinks_check):
        sinks = [name for name in errors if name.endswith("sinks")]
        assert len(sinks) == 2, errors
        worst = max(errors, key=errors.get)
        assert errors[worst] < TOL, f"grad of {worst}: rel err {errors[worst]}"


def test_config_refuses_sinks_or_windows_on_the_flash_attn_package(monkeypatch):
    import types

    from xorl.config.rules.model import attention_problems
    from xorl.models import families

    def model(**fields):
        return types.SimpleNamespace(model_type="llama", attn_implementation="flash_attn", **fields)

    windowed = attention_problems(model(sliding_window=128))
    assert any("not wired for its sliding windows; use attn_implementation: xorl" in p for p in windowed), windowed
    assert not any("not wired" in p for p in attention_problems(model(sliding_window=None)))
    for name in ("xorl", "sdpa"):  # both run sinks and windows
        m = types.SimpleNamespace(model_type="llama", attn_implementation=name, sliding_window=128)
        assert attention_problems(m) == []
    llama = families.family("llama")
    monkeypatch.setattr(families, "family", lambda t: types.SimpleNamespace(**{**vars(llama), "attention_sinks": True}))
    sinks = attention_problems(model())
    assert any("not wired for its attention sinks" in p for p in sinks), sinks
