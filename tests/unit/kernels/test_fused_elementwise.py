"""RMSNorm (+ residual), RoPE and SwiGLU ops (xorl_kernels/rmsnorm, rope, activation) vs float64.

The references are written out here in float64 with autograd (the textbook formulas, not the ops'
reference modules), on odd shapes that cross the interpreter's tiles. Both backends run: Triton
(compiled on a GPU, under the interpreter on CPU: tests/support/triton_helpers.py) and the plain-torch
reference. RoPE runs every variant transformers computes tables for (default, linear, dynamic,
llama3, yarn, longrope) through its own ROPE_INIT_FUNCTIONS, and partial rotary.
Whole-model parity against today's eager ops: ``test_model_matches_eager_ops`` (and
tests/unit/models/test_hf_parity.py against transformers' classes).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_helpers import to_triton
from xorl_kernels.activation.op import swiglu
from xorl_kernels.rmsnorm.op import rms_norm
from xorl_kernels.rope.op import apply_rotary

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
BACKENDS = ["triton", "reference"]


def rel_err(out, ref) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _run(fn, inputs, grads_out, backend, dtype):
    """fn on (inputs cast to dtype, on the backend's device) -> outputs and input gradients (CPU)."""
    xs = [t.to(dtype) for t in inputs]
    if backend == "triton":
        xs = [to_triton(t) for t in xs]
    xs = [t.requires_grad_() for t in xs]
    outs = fn(*xs, backend=backend)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(((o.float() * g.to(o.device)).sum() for o, g in zip(outs, grads_out)), torch.zeros(())).backward()
    return [o.cpu() for o in outs], [x.grad.cpu() for x in xs]


def _float64(fn, inputs, grads_out):
    xs = [t.double().requires_grad_() for t in inputs]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum((o * g.double()).sum() for o, g in zip(outs, grads_out)).backward()
    return outs, [x.grad for x in xs]


def _check(fn, ref_fn, inputs, out_shapes, backend, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    grads_out = [torch.randn(s, generator=g) for s in out_shapes]
    ref_outs, ref_grads = _float64(ref_fn, inputs, grads_out)
    outs, grads = _run(fn, inputs, grads_out, backend, dtype)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert rel_err(o, r) < TOL[dtype], f"output {i}: {rel_err(o, r):.2e}"
    for i, (d, r) in enumerate(zip(grads, ref_grads)):
        assert rel_err(d, r) < TOL[dtype], f"grad {i}: {rel_err(d, r):.2e}"


def _rms64(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 37), (1, 1, 64), (7, 3, 4, 10)])
def test_rms_norm(backend, dtype, shape):
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x, w = torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    _check(lambda x, w, backend: rms_norm(x, w, 1e-6, backend=backend), _rms64, [x, w], [shape], backend, dtype, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(backend, dtype):
    g = torch.Generator().manual_seed(3)
    shape = (2, 9, 45)
    x, r, w = torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(45, generator=g)

    def ref(x, r, w):
        h = x + r
        return _rms64(h, w, 1e-5), h

    _check(lambda x, r, w, backend: rms_norm(x, w, 1e-5, r, backend=backend), ref, [x, r, w], [shape, shape],
           backend, dtype, 4)


def _rope_tables(rope_type: str, head_dim: int, positions: torch.Tensor, partial: float = 1.0):
    """cos / sin [1, seq, rot] from transformers' own RoPE initialisers (every scaled variant)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": partial}
    params.update({
        "linear": {"factor": 4.0}, "dynamic": {"factor": 2.0},
        "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": 64},
        "longrope": {"short_factor": [1.0 + 0.1 * i for i in range(int(head_dim * partial) // 2)],
                     "long_factor": [2.0 + 0.1 * i for i in range(int(head_dim * partial) // 2)],
                     "original_max_position_embeddings": 64},
    }.get(rope_type, {}))
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=256, rope_parameters=params)
    if rope_type == "default":
        inv_freq, scale = 1.0 / (10000.0 ** (torch.arange(0, int(head_dim * partial), 2).double()
                                             / int(head_dim * partial))), 1.0
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=128)
    freqs = positions[:, None].double() * inv_freq.double()
    emb = torch.cat([freqs, freqs], -1)
    return (emb.cos() * scale).unsqueeze(0).float(), (emb.sin() * scale).unsqueeze(0).float()


def _rope64(x, cos, sin):
    rot = cos.shape[-1]
    c, s = cos.double().unsqueeze(2), sin.double().unsqueeze(2)
    head = x[..., :rot]
    x1, x2 = head.chunk(2, -1)
    return torch.cat([head * c + torch.cat([-x2, x1], -1) * s, x[..., rot:]], -1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rope_type,partial", [("default", 1.0), ("linear", 1.0), ("dynamic", 1.0),
                                               ("llama3", 1.0), ("yarn", 1.0), ("longrope", 1.0),
                                               ("default", 0.5), ("yarn", 0.25)])
def test_rope_variants(backend, rope_type, partial):
    head_dim, seq = 24, 11
    positions = torch.randperm(100, generator=torch.Generator().manual_seed(0))[:seq]
    cos, sin = _rope_tables(rope_type, head_dim, positions, partial)
    x = torch.randn(2, seq, 5, head_dim, generator=torch.Generator().manual_seed(1))

    def fn(x, backend):
        c, s = (to_triton(cos), to_triton(sin)) if backend == "triton" else (cos, sin)
        return apply_rotary(x, c.to(x.dtype), s.to(x.dtype), backend=backend)

    _check(fn, lambda x: _rope64(x, cos, sin), [x], [x.shape], backend, torch.float32, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("merged", [False, True])
def test_swiglu(backend, dtype, merged):
    g = torch.Generator().manual_seed(5)
    units = 45
    if merged:  # the interleaved gate_up projection, read in place
        gu = torch.randn(3, 7, 2 * units, generator=g) * 2

        def fn(gu, backend):
            v = gu.view(*gu.shape[:-1], -1, 2)
            return swiglu(v[..., 0], v[..., 1], backend=backend)

        def ref(gu):
            v = gu.view(*gu.shape[:-1], -1, 2)
            return F.silu(v[..., 0]) * v[..., 1]

        _check(fn, ref, [gu], [(3, 7, units)], backend, dtype, 6)
    else:
        gate, up = torch.randn(4, units, generator=g) * 2, torch.randn(4, units, generator=g)
        _check(lambda a, b, backend: swiglu(a, b, backend=backend), lambda a, b: F.silu(a) * b, [gate, up],
               [(4, units)], backend, dtype, 7)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 4), torch.randn(5), 1e-6)
    with pytest.raises(ValueError, match="rot"):
        apply_rotary(torch.randn(1, 3, 2, 4), torch.randn(1, 3, 6), torch.randn(1, 3, 6))
    with pytest.raises(ValueError, match="must match"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))


# -- whole model: the fused ops vs today's eager arithmetic ---------------------------------------

def _eager_rms_forward(self, x, residual=None):
    if residual is not None:
        x = x + residual
    input_dtype, h = x.dtype, x
    x32 = x.to(torch.float32)
    y = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(input_dtype)
    return y if residual is None else (y, h)


def _eager_rotary(x, cos, sin):
    from xorl.models.layers import rotate_half

    return x * cos.unsqueeze(2) + rotate_half(x) * sin.unsqueeze(2)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_model_matches_eager_ops(model_type, monkeypatch):
    """Logits and every gradient of a model on the fused ops == the same model on eager ops (<= 1e-5)."""
    import xorl.models.attention as attention
    import xorl.models.layers as layers
    import xorl.nn.moe as moe
    import xorl.nn.moe_experts as moe_experts
    import xorl.nn.rms_norm as rms_norm_module
    from xorl.config import ModelConfig
    from xorl.models import build_model

    config = ModelConfig(model_type=model_type, vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, merge_gate_up=True)
    if model_type == "qwen3_moe":
        config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size = 4, 2, 32
    torch.manual_seed(0)
    model = build_model(config)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 13))
    labels = torch.randint(0, 96, (2, 13))

    def step(m):
        logits = m(ids).logits
        out = m(ids, labels=labels)
        (out.loss + (out.router_loss if out.router_loss is not None else 0)).backward()
        return logits, {n: p.grad for n, p in m.named_parameters()}

    fused_logits, fused_grads = step(model)
    with monkeypatch.context() as patch:
        patch.setattr(rms_norm_module.RMSNorm, "forward", _eager_rms_forward)
        patch.setattr(attention, "apply_rotary", _eager_rotary)
        eager_swiglu = lambda g, u: F.silu(g) * u  # noqa: E731
        for module in (layers, moe, moe_experts):
            patch.setattr(module, "swiglu", eager_swiglu)
        eager_logits, eager_grads = step(eager)
    assert rel_err(fused_logits, eager_logits) < 1e-5
    for name, grad in fused_grads.items():
        assert rel_err(grad, eager_grads[name]) < 1e-5, name
