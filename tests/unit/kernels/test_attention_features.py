"""flash_attn's model-family features against float64 plain torch: head_dim_v != head_dim_qk (MLA),
attention sinks (gpt-oss) and causal sliding windows, alone and together, on packed documents,
zig-zag positions and GQA, forward (out, lse) and gradients of q, k, v and the sinks.

The oracle (tests/support/attention_oracle.py) is independent of attention/reference.py and of the kernels: one
dense [total_q, total_k] mask from document ids and positions, the sinks as one more column of the
scores, softmax, matmul, differentiated by torch autograd in float64. A second oracle is
transformers' own gpt-oss eager attention with a mask from transformers' masking_utils (which
also pins the window convention). Triton runs compiled on a GPU and under TRITON_INTERPRET=1 on
the CPU (tests/support/triton_helpers.py), so shapes stay small; kernel outputs are NaN-poisoned first.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.attention_oracle import (
    F64,
    check_packed,
    dense_attention,
    docs,
    make_inputs,
    poison_outputs,
    rel_err,
    token_meta,
    zigzag_shard_meta,
)
from tests.support.triton_helpers import triton_device
from xorl_kernels.attention import common
from xorl_kernels.attention.merge import merge_attn_states
from xorl_kernels.attention.op import (
    apply_sinks,
    flash_attn,
    flash_attn_backward,
    flash_attn_bwd_preprocess,
    flash_attn_forward,
    flash_attn_with_lse,
    sink_grad,
)

BACKENDS = ["reference", "torch_cpu", "triton"]  # torch_cpu: torch's CPU flash kernel (attention/cpu_flash.py)


@pytest.fixture
def poisoned(monkeypatch):
    poison_outputs(monkeypatch)


# -- every feature, each backend -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_v_differs(poisoned, backend, causal):
    """MLA-like 24 (q·k) / 16 (v), packed uneven documents, GQA 4/2; no sinks, no window."""
    cu = docs(21, 7, 36)
    q, k, v, _ = make_inputs(0, 64, 64, 4, 2, 24, 16, sinks=False)
    check_packed(backend, torch.float32, q, k, v, cu, cu, causal, sinks=None, seed=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d_qk, d_v", [(48, 32), (192, 128)])
def test_head_dim_qk_in_two_chunks(poisoned, backend, d_qk, d_v):
    """q·k head dims that the Triton kernels run as two power-of-two chunks (48 = 32 + 16; MLA's
    192 = 128 + 64), with sinks, a window and zig-zag-like ascending positions split in two runs."""
    assert common.qk_chunks(d_qk)["HEAD_B"] > 0
    cu = docs(20, 13)
    pos = torch.cat([torch.arange(20), torch.arange(13)]).int()
    q, k, v, s = make_inputs(7, 33, 33, 2, 1, d_qk, d_v)
    check_packed(backend, torch.float32, q, k, v, cu, cu, True, pos, pos, sinks=s, seed=3, window=6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_sinks(poisoned, backend, causal):
    """Sinks with packed documents, GQA, q·k 16 / v 32; an empty key document gives out 0, lse = sink."""
    cu_q, cu_k = docs(19, 5, 24), docs(23, 0, 30)
    q, k, v, s = make_inputs(1, 48, 53, 4, 1, 16, 32)
    out, lse, _ = check_packed(backend, torch.float32, q, k, v, cu_q, cu_k, causal, sinks=s, seed=3)
    assert torch.all(out[19:24].cpu() == 0)
    assert torch.allclose(lse[:, 19:24].cpu().double(), s.float().double()[:, None].expand(-1, 5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [5, 24, 40])
def test_window(poisoned, backend, window):
    """Window smaller than, equal to and larger than the longest document (24), with sinks, GQA and
    d_qk 24 / d_v 16; documents of 24, 9 and 17 tokens."""
    cu = docs(24, 9, 17)
    q, k, v, s = make_inputs(2 + window, 50, 50, 4, 2, 24, 16)
    check_packed(backend, torch.float32, q, k, v, cu, cu, True, sinks=s, seed=3, window=window)
    check_packed(backend, torch.float32, q, k, v, cu, cu, True, sinks=None, seed=3, window=window)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [3, 11])
def test_window_zigzag_positions(poisoned, backend, window):
    """A zig-zag shard (two runs of each document, true positions) against its full-sequence keys,
    rows whose window lies wholly in the other run included; sinks and d_qk != d_v."""
    lengths, world, rank = [48, 32], 2, 1
    _, pos_q, cu_q = zigzag_shard_meta(lengths, world, rank)
    pos_k = torch.cat([torch.arange(n) for n in lengths]).int()
    q, k, v, s = make_inputs(5 + window, pos_q.numel(), sum(lengths), 2, 2, 16, 24)
    check_packed(backend, torch.float32, q, k, v, cu_q, docs(*lengths), True, pos_q, pos_k, sinks=s, seed=3,
                 window=window)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_layout_bf16(poisoned, backend):
    """Batched [B, S, H, D] layout in bf16 with everything on: d 32/16, GQA, sinks, window 6."""
    gen = torch.Generator().manual_seed(11)
    q, k = (torch.randn(2, 40, h, 32, generator=gen) for h in (4, 2))
    v = torch.randn(2, 40, 2, 16, generator=gen)
    s = torch.randn(4, generator=gen)
    device = triton_device() if backend == "triton" else torch.device("cpu")
    args = [t.to(device, torch.bfloat16) for t in (q, k, v)]
    out, lse = flash_attn_with_lse(*args, causal=True, window=6, sinks=s.to(device), backend=backend)
    flat = [t.to(torch.bfloat16).double().reshape(80, *t.shape[2:]) for t in (q, k, v)]
    cu = docs(40, 40)
    doc, pos = token_meta(cu, None)
    ref_out, ref_lse = dense_attention(*flat, doc, doc, pos, pos, True, 32 ** -0.5, 6, s.double())
    assert rel_err(out.reshape(80, 4, 16), ref_out) < 1e-2
    assert rel_err(lse.transpose(0, 1).reshape(4, 80), ref_lse) < 1e-2


# -- the ring pieces: steps without sinks, merged, the sink applied once ---------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_decomposition_with_sinks_and_window(poisoned, backend):
    """Keys split in two (as two ring steps), each step's forward without sinks, merge_attn_states,
    then apply_sinks once; backward: every step with the final lse / delta, sink_grad once. Equals
    the oracle over all keys, gradients of q, k, v and sinks included."""
    device = triton_device() if backend == "triton" else torch.device("cpu")
    total, cut, window = 40, 17, 9
    q, k, v, s = make_inputs(21, total, total, 4, 2, 24, 16)
    pos = torch.arange(total, dtype=torch.int32)
    cu = docs(total)
    qd, kd, vd, sd = (t.float().to(device) for t in (q, k, v, s))
    parts = [(0, cut), (cut, total)]
    mask = dict(causal=True, window=window, backend=backend, q_positions=pos.to(device))
    merged = None
    for a, b in parts:
        step = flash_attn_forward(qd, kd[a:b], vd[a:b], cu_seqlens_q=cu.to(device),
                                  cu_seqlens_k=docs(b - a).to(device), k_positions=pos[a:b].to(device), **mask)
        merged = step if merged is None else merge_attn_states(*merged, *step)
    out, lse = apply_sinks(*merged, sd)

    gen = torch.Generator().manual_seed(4)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    delta = flash_attn_bwd_preprocess(out, dout.float().to(device), backend=backend)
    dq = torch.zeros(qd.shape, device=device)
    dk, dv = torch.zeros(kd.shape, device=device), torch.zeros(vd.shape, device=device)
    for a, b in parts:
        flash_attn_backward(dout.float().to(device), qd, kd[a:b], vd[a:b], out, lse, delta,
                            cu_seqlens_q=cu.to(device), cu_seqlens_k=docs(b - a).to(device),
                            k_positions=pos[a:b].to(device), dq_accum=dq, dk_accum=dk[a:b], dv_accum=dv[a:b],
                            **mask)
    dsinks = sink_grad(lse, delta, sd)

    leaves = [t.float().double().requires_grad_() for t in (q, k, v, s)]
    doc, p = token_meta(cu, None)
    ref_out, ref_lse = dense_attention(*leaves[:3], doc, doc, p, p, True, 24 ** -0.5, window, leaves[3])
    ref_grads = torch.autograd.grad((ref_out * dout).sum(), leaves)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(lse, ref_lse) < 1e-5
    for name, g, ref in zip(["q", "k", "v", "sinks"], (dq, dk, dv, dsinks), ref_grads):
        assert rel_err(g, ref) < 1e-5, f"d{name}"
    # The one-call low-level backward with sinks gives the same dsinks as its 4th result.
    full = flash_attn_backward(dout.float().to(device), qd, kd, vd, out, lse, delta, cu_seqlens=cu.to(device),
                               k_positions=pos.to(device), sinks=sd, **mask)
    assert len(full) == 4 and rel_err(full[3], ref_grads[3]) < 1e-5


def test_apply_sinks_on_empty_rows():
    """lse = -inf (no key anywhere) plus a sink: out 0, lse = sink, finite gradients."""
    out = torch.zeros(3, 2, 4, dtype=F64)
    lse = torch.full((2, 3), float("-inf"), dtype=F64).requires_grad_()
    s = torch.tensor([0.5, -1.0], dtype=F64, requires_grad=True)
    new_out, new_lse = apply_sinks(out, lse, s)
    assert torch.all(new_out == 0) and torch.equal(new_lse, s.detach()[:, None].expand(2, 3))
    (gl, gs) = torch.autograd.grad(new_lse.sum(), (lse, s))
    assert torch.isfinite(gl).all() and torch.equal(gs, torch.full((2,), 3.0, dtype=F64))


# -- second oracle: transformers' gpt-oss eager attention ---------------------------------------


@pytest.mark.parametrize("window", [None, 5])
def test_against_transformers_gpt_oss_eager(window):
    """transformers' GptOss eager_attention_forward (sinks column, max-subtracted softmax) with the
    mask built from transformers' masking_utils causal / sliding-window mask functions."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(17)
    b, s_len, hq, hk, d = 2, 13, 4, 2, 16
    q, k, v = (torch.randn(b, h, s_len, d, generator=gen, dtype=F64) for h in (hq, hk, hk))
    sinks = torch.randn(hq, generator=gen, dtype=F64)
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    idx = torch.arange(s_len)
    allowed = fn(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :]).expand(s_len, s_len)
    additive = torch.zeros(s_len, s_len, dtype=F64).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=hq // hk, sinks=sinks, training=False)
    ref, _ = eager_attention_forward(module, q, k, v, additive[None, None], scaling=d ** -0.5)
    ours = flash_attn(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, window=window, sinks=sinks,
                      backend="reference")
    assert rel_err(ours, ref) < 1e-12


# -- argument checks and defaults --------------------------------------------------------------


def test_argument_errors():
    q, k, v, s = make_inputs(0, 8, 8, 2, 1, 16, 8)
    cu = docs(8)
    with pytest.raises(ValueError, match="needs causal=True"):
        flash_attn(q, k, v, cu_seqlens=cu, window=4)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        flash_attn(q, k, v, causal=True, cu_seqlens=cu, window=0)
    with pytest.raises(ValueError, match="sinks must be a float tensor"):
        flash_attn(q, k, v, causal=True, cu_seqlens=cu, sinks=torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="k and v must match"):
        flash_attn(q, k, v[:4], causal=True, cu_seqlens=cu)


def test_fake_tensor_shapes_with_head_dim_v():
    """The custom op's fake implementation gives v's head dim to out (torch.compile traces through it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 8, 4, 24), torch.empty(2, 8, 2, 24)
        v = torch.empty(2, 8, 2, 16)
        out, lse = flash_attn_with_lse(q, k, v, causal=True, window=3, sinks=torch.empty(4))
    assert tuple(out.shape) == (2, 8, 4, 16) and tuple(lse.shape) == (2, 4, 8)


def test_window_needs_ascending_positions():
    """Windows find their bounds by searching positions: a drop inside a document is refused (CPU
    check); a drop at a document boundary is fine."""
    q, k, v, _ = make_inputs(0, 8, 8, 2, 1, 16, 16, sinks=False)
    cu = docs(4, 4)
    good = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3], dtype=torch.int32)
    flash_attn(q, k, v, causal=True, cu_seqlens=cu, window=2, q_positions=good, k_positions=good)
    bad = torch.tensor([0, 2, 1, 3, 0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing inside each document"):
        flash_attn(q, k, v, causal=True, cu_seqlens=cu, window=2, q_positions=good, k_positions=bad)
    flash_attn(q, k, v, causal=True, cu_seqlens=cu, q_positions=good, k_positions=bad)  # no window: any positions


def test_compile_fullgraph_with_sinks_window_and_head_dim_v():
    """torch.compile (aot_eager, fullgraph) traces the custom op with the new arguments and gives the
    eager gradients, sinks included (the fake and the backward's fake carry d_v and dsinks)."""
    gen = torch.Generator().manual_seed(31)
    q, k = torch.randn(2, 16, 4, 24, generator=gen), torch.randn(2, 16, 2, 24, generator=gen)
    v, s = torch.randn(2, 16, 2, 16, generator=gen), torch.randn(4, generator=gen)
    leaves = [t.requires_grad_() for t in (q, k, v, s)]

    def loss(q, k, v, s):
        return flash_attn(q, k, v, causal=True, window=5, sinks=s).square().sum()

    eager = torch.autograd.grad(loss(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(*leaves), leaves)
    for a, b in zip(eager, compiled):
        assert rel_err(b, a) < 1e-6


# -- compiled and autotuned on a GPU (skipped on CPU) ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d_qk, d_v, hq, hk, window, with_sinks", [
    (192, 128, 8, 8, None, False),  # DeepSeek-V3 MLA (q·k in two chunks)
    (64, 64, 8, 1, 128, True),  # gpt-oss sliding layer: GQA, W = 128, sinks
    (128, 128, 8, 2, 700, False),  # a window longer than one document, shorter than another
])
def test_gpu_features(poisoned, dtype, d_qk, d_v, hq, hk, window, with_sinks):
    """Packed uneven documents (1024, 384, 640), causal, gradients of q, k, v (and sinks)."""
    cu = docs(1024, 384, 640)
    q, k, v, s = make_inputs(13, 2048, 2048, hq, hk, d_qk, d_v, sinks=with_sinks)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    check_packed("triton", dtype, q, k, v, cu, cu, True, sinks=s, seed=3, window=window, tol=tol)
