"""RingAttention against float64 single-process attention, for ring sizes 1, 2, 4, 8.

Every case shards fresh random q/k/v/dout with the zig-zag layout, runs forward + backward on the
gloo ranks, and compares this rank's output and dq/dk/dv with the matching shard of the float64
reference. Packed documents of uneven lengths go through prepare_context_parallel_batch, so pad
tokens are present in the ring but absent from the reference: only real tokens are compared, and
the pads' dout is 0 (the loss ignores them). Bytes sent are counted by wrapping torch.distributed.
"""

import pytest
import torch
import torch.distributed as dist

from tests.support.cp_helpers import (
    DOC_LENS,
    FULL_DOCS,
    SendCounter,
    local_inputs,
    rel_err,
    run_case,
    sq_err,
)
from xorl.nn.ring_attention import RingAttention

TOL = 1e-5
# (name, causal, batch, layout kind, document lengths / boundaries / seq, heads_q, heads_kv)
CASES = [
    ("causal packed padded GQA", True, 1, "padded", DOC_LENS, 4, 2),
    ("causal batched MQA", True, 2, "batched", 32, 4, 1),
    ("full packed MHA", False, 1, "packed", FULL_DOCS, 2, 2),
]


def _ring_errors(seed):
    group = dist.group.WORLD
    return [run_case(RingAttention(group, causal=case[1]), case, group, seed=seed) for case in CASES]


def _errors_per_case(per_rank):
    """per_rank[rank][case][tensor] pieces -> [case][tensor] relative errors."""
    return [[rel_err([r[c][t] for r in per_rank]) for t in range(4)] for c in range(len(CASES))]


def test_ring_matches_float64_reference_and_error_does_not_grow_with_ring_size(gloo_world):
    errors = {1: _errors_per_case([[run_case(RingAttention(None, causal=c[1]), c, None) for c in CASES]])}
    for size in (2, 4, 8):
        errors[size] = _errors_per_case(gloo_world(size).run(_ring_errors, 0))
    for size, per_case in errors.items():
        for (name, *_), errs in zip(CASES, per_case):
            assert max(errs) < TOL, f"P={size} {name}: rel err out/dq/dk/dv = {errs}"
    for c, (name, *_) in enumerate(CASES):
        for t in range(4):
            assert errors[8][c][t] <= 2 * errors[2][c][t] + 1e-6, f"{name}: error grows with P: {errors}"


# Sinks, sliding windows, head_dim_v != head_dim_qk (options: the 8th field, see cp_helpers). At
# P = 4 the batched 64-token rows have chunks of 8 and shards of 16: window 5 lies inside a chunk
# (most steps see no key and skip their compute), window 40 spans more than a shard.
FEATURE_CASES = [
    ("batched GQA, sinks, window 5 < chunk, d_v 12", True, 2, "batched", 64, 4, 2,
     {"sinks": True, "window": 5, "d_v": 12}),
    ("batched MQA, window 40 > shard, d_v 4", True, 1, "batched", 64, 4, 1, {"window": 40, "d_v": 4}),
    ("causal packed padded GQA, sinks, window 6, d_v 12", True, 1, "padded", DOC_LENS, 4, 2,
     {"sinks": True, "window": 6, "d_v": 12}),
    ("causal packed MHA, sinks, no window", True, 1, "packed", FULL_DOCS, 2, 2, {"sinks": True}),
    ("full packed MHA, sinks, d_v 4", False, 1, "packed", FULL_DOCS, 2, 2, {"sinks": True, "d_v": 4}),
]  # fmt: skip


def _feature_errors(seed):
    group = dist.group.WORLD
    return [run_case(RingAttention(group, causal=c[1]), c, group, seed=seed) for c in FEATURE_CASES]


@pytest.mark.parametrize("size", [2, 4])
def test_ring_with_sinks_windows_and_narrow_v_matches_float64_reference(gloo_world, size):
    """Outputs and gradients of q, k, v and the sinks (summed over the ranks, as the gradient
    reduction over the CP ranks does) against one float64 process."""
    per_rank = gloo_world(size).run(_feature_errors, 5)
    single = [run_case(RingAttention(None, causal=c[1]), c, None, seed=5) for c in FEATURE_CASES]
    for c, case in enumerate(FEATURE_CASES):
        tensors = len(per_rank[0][c])
        assert tensors == (5 if case[7].get("sinks") else 4)
        errs = [rel_err([r[c][t] for r in per_rank]) for t in range(tensors)]
        assert max(errs) < TOL, f"P={size} {case[0]}: rel err out/dq/dk/dv(/dsinks) = {errs}"
        errs_1 = [rel_err([single[c][t]]) for t in range(tensors)]
        assert max(errs_1) < TOL, f"P=1 {case[0]}: rel err out/dq/dk/dv(/dsinks) = {errs_1}"


def _steps_computed(window):
    """How many ring steps ran the kernel, forward and backward, on this rank (64 tokens, P = 4)."""
    from xorl.nn import ring_step_kernel

    group = dist.group.WORLD
    calls = {"forward": 0, "backward": 0}
    original = {name: getattr(ring_step_kernel.ZigzagStepKernel, name) for name in calls}

    def counting(name):
        def call(self, *args):
            calls[name] += 1
            return original[name](self, *args)

        return call

    case = ("batched", True, 1, "batched", 64, 2, 2, {"window": window})
    for name in calls:
        setattr(ring_step_kernel.ZigzagStepKernel, name, counting(name))
    try:
        errors = run_case(RingAttention(group), case, group, seed=2)
    finally:
        for name, fn in original.items():
            setattr(ring_step_kernel.ZigzagStepKernel, name, fn)
    return calls, errors


def test_ring_skips_steps_outside_every_window(gloo_world):
    """Chunks of 8 at P = 4: with window 5 only the own block and the two neighbouring ranks'
    blocks hold keys a local query can see (chunk a sees chunk a - 1 at distance >= 1; any other
    chunk is >= 9 away), so rank r computes the steps of k_rank in {r - 1, r, r + 1} only; with
    window 40 (> a shard) every step computes. Results stay exact either way."""
    for window, expected in ((5, [2, 3, 3, 2]), (40, [4, 4, 4, 4])):
        results = gloo_world(4).run(_steps_computed, window)
        assert [r[0]["forward"] for r in results] == expected, (window, results)
        assert [r[0]["backward"] for r in results] == expected, (window, results)
        errs = [rel_err([r[1][t] for r in results]) for t in range(4)]
        assert max(errs) < TOL, (window, errs)


def _bytes_sent(dkv_comm_dtype):
    group = dist.group.WORLD
    case = CASES[0]
    (q, k, v, do), refs, real, cu, max_seqlen = local_inputs(case, group, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attn = RingAttention(group, dkv_comm_dtype=dkv_comm_dtype)
    fwd, bwd = SendCounter(), SendCounter()
    with fwd.active():
        out = attn(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen)
    with bwd.active():
        out.backward(do)
    kv_block = 2 * k.numel() * k.element_size()
    errs = [sq_err(a[:, real], b[:, real]) for a, b in zip((out, q.grad, k.grad, v.grad), refs)]
    return fwd.p2p_sends, bwd.p2p_sends, kv_block, errs


@pytest.mark.parametrize("dkv_dtype,dkv_bytes,tol", [(torch.float32, 4, TOL), (torch.bfloat16, 2, 1e-2)])
def test_ring_sends_exactly_the_analytic_bytes(gloo_world, dkv_dtype, dkv_bytes, tol):
    size = 4
    results = gloo_world(size).run(_bytes_sent, dkv_dtype)
    for fwd, bwd, kv_block, _ in results:
        # Forward: P-1 hops of one K+V block. Backward: K+V again, and P-1 hops of dK+dV.
        assert fwd == [kv_block] * (size - 1)
        dkv_block = kv_block // 4 * dkv_bytes
        assert sorted(bwd) == sorted([kv_block] * (size - 1) + [dkv_block] * (size - 1))
    errs = [rel_err([r[3][t] for r in results]) for t in range(4)]
    assert max(errs) < tol, errs


def test_bad_inputs_raise_clear_errors():
    attn = RingAttention(None)
    q = torch.randn(2, 8, 4, 8)
    with pytest.raises(ValueError, match="batch must be 1"):
        attn(q, q, q, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="kv heads dividing q heads"):
        attn(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(ValueError, match="attn_backend"):
        RingAttention(None, attn_backend="cudnn")
    with pytest.raises(ValueError, match=r"sinks must be \[heads_q\] = \[4\]"):
        attn(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="use causal=True and window >= 1"):
        RingAttention(None, causal=False)(q, q, q, window=4)
    with pytest.raises(ValueError, match="not wired for attention sinks or sliding windows"):
        RingAttention(None, attn_backend="flash_attn")(q, q, q, window=4)


# ----------------------------------------------------------------------------------------------
# attn_backend="flash_attn": the package is not installed here, so a stand-in with flash-attn's
# varlen signatures (computing through the xorl reference) checks our zig-zag-to-varlen mapping.
# ----------------------------------------------------------------------------------------------
def _install_fake_flash_attn():
    import sys
    import types

    from xorl_kernels.attention.reference import reference_backward, reference_bwd_preprocess, reference_forward

    def fwd(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
    ):
        assert q.shape[0] == int(cu_seqlens_q[-1]) and k.shape[0] == int(cu_seqlens_k[-1])
        assert max_seqlen_q >= int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        out, lse = reference_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        return out, lse, None, None

    def bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        delta = reference_bwd_preprocess(out, dout)
        grads = reference_backward(dout, q, k, v, softmax_lse, delta, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        for buf, grad in zip((dq, dk, dv), grads):
            buf.copy_(grad)
        return delta

    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_varlen_forward, interface._flash_attn_varlen_backward = fwd, bwd
    package = types.ModuleType("flash_attn")
    package.flash_attn_interface = interface
    sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"] = package, interface


def _flash_attn_backend_errors():
    import sys

    saved = {name: sys.modules.get(name) for name in ("flash_attn", "flash_attn.flash_attn_interface")}
    _install_fake_flash_attn()
    try:
        group = dist.group.WORLD
        return [run_case(RingAttention(group, causal=c[1], attn_backend="flash_attn"), c, group) for c in CASES]
    finally:  # the rank processes are reused: later checks (transformers) must not see the stand-in
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def test_flash_attn_package_backend_maps_zigzag_steps_to_varlen_calls(gloo_world):
    per_case = _errors_per_case(gloo_world(4).run(_flash_attn_backend_errors))
    for (name, *_), errs in zip(CASES, per_case):
        assert max(errs) < TOL, f"flash_attn backend, {name}: rel err out/dq/dk/dv = {errs}"


def test_zigzag_step_in_window_matches_brute_force_over_positions():
    """The static skip rule against every (query, key) pair of the two ranks' true positions."""
    from xorl_kernels.zigzag.layout import zigzag_positions, zigzag_step_in_window

    for world in (2, 3, 4):
        for chunk in (1, 2, 5):
            pos = zigzag_positions(2 * world * chunk, None, world).view(world, 2 * chunk)
            for window in range(1, 4 * world * chunk):
                for q_rank in range(world):
                    for k_rank in range(world):
                        diff = pos[q_rank][:, None] - pos[k_rank][None, :]
                        seen = bool(((diff >= 0) & (diff < window)).any())
                        got = zigzag_step_in_window(q_rank, k_rank, world, chunk, window)
                        assert got == seen, (world, chunk, window, q_rank, k_rank)


def test_static_skip_table_for_packed_documents_follows_the_shortest_document():
    """_active_steps on host cu_seqlens: a step is skipped only when no document has a visible pair."""
    from xorl.nn.ring_step_kernel import _active_steps
    from xorl_kernels.zigzag.layout import zigzag_positions

    world, cu = 4, torch.tensor([0, 16, 80, 144])  # chunks of 2, 8 and 8
    local = int(cu[-1]) // world
    pos = zigzag_positions(int(cu[-1]), None, world, cu, within_document=True).view(world, local)
    doc = torch.searchsorted(cu[1:] // world, torch.arange(local), right=True)
    for window in (1, 2, 4, 5, 9, 17, 40):
        table = _active_steps(cu, world, local, window)
        for q_rank in range(world):
            for k_rank in range(world):
                diff = pos[q_rank][:, None] - pos[k_rank][None, :]
                seen = bool(((diff >= 0) & (diff < window) & (doc[:, None] == doc[None, :])).any())
                assert table[q_rank][k_rank] == seen, (window, q_rank, k_rank)
    assert _active_steps(cu, world, local, None) is None and _active_steps(cu, 1, local, 5) is None
