"""gpt-oss pieces beyond the family parity (tests/unit/models/test_families.py): MXFP4 expert weights
read by dequantising on load, box by box; the clamped SwiGLU; routing with the router's bias.

The MXFP4 reference is written out here: each nibble decoded from its bits (sign, 2 exponent bits,
1 mantissa bit of e2m1) times 2 ** (scale - 127) in float64, sharing nothing with the dequantiser,
and transformers' own convert_moe_packed_tensors where it imports on this machine.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import xorl.models  # noqa: E402
from tests.support.paths import REPO  # noqa: E402
from tests.unit.models.test_families import hf_checkpoint, rel_err  # noqa: E402
from xorl.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402


def decode_e2m1_float64(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] bytes, [..., G] exponents -> [..., G * 32] float64, bit by bit."""
    nibbles = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # low nibble first
    sign = torch.where(nibbles & 8 > 0, -1.0, 1.0).double()
    exponent, mantissa = (nibbles >> 1) & 3, (nibbles & 1).double()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, 2.0 ** (exponent.double() - 1) * (1 + 0.5 * mantissa))
    value = sign * magnitude * 2.0 ** (scales.double() - 127).unsqueeze(-1)
    return value.flatten(-2)


def random_mxfp4(shape_rows: tuple[int, ...], in_features: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape_rows, in_features // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 132, (*shape_rows, in_features // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_bitwise_decode_and_transformers(dtype):
    blocks, scales = random_mxfp4((3, 10), 96, seed=0)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 10, 96) and ours.dtype == dtype
    # e2m1 values times powers of two are exact in bf16 and fp32 at these exponents.
    assert torch.equal(ours.double(), decode_e2m1_float64(blocks, scales))
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError:  # pragma: no cover - depends on the installed transformers
        return
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_quantize_round_trip():
    """Values already on the MXFP4 grid come back exactly; random ones within half a grid step."""
    blocks, scales = random_mxfp4((4, 6), 64, seed=1)
    exact = decode_e2m1_float64(blocks, scales).float()
    b2, s2 = quantize_mxfp4(exact)
    assert torch.equal(dequantize_mxfp4(b2, s2, torch.float32), exact)
    w = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(2))
    back = dequantize_mxfp4(*quantize_mxfp4(w), torch.float32)
    step = 2.0 ** (quantize_mxfp4(w)[1].double() - 127)  # the grid's largest step per block (6 -> 4: 2 x scale)
    err = (back.double() - w.double()).abs().view(5, 7, 2, 32)
    assert bool((err <= step.unsqueeze(-1) + 1e-12).all())
    assert rel_err(back, w) < 0.2


def mxfp4_folder(tmp_path, seed: int = 1):
    """transformers' tiny gpt-oss checkpoint with its experts re-stored as MXFP4 blocks and scales
    (quantised here); returns (HF model holding the dequantised weights, folder)."""
    hf = hf_checkpoint("gpt_oss", tmp_path / "hf", seed=seed, intermediate_size=64, hidden_size=64)
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    with torch.no_grad():
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())  # [E, out, in]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            module, attr = name.rsplit(".", 1)
            dequantized = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
            getattr(hf.get_submodule(module), attr).copy_(dequantized)
    save_file(tensors, path, metadata={"format": "pt"})
    return hf, tmp_path / "hf"


def test_mxfp4_checkpoint_loads_to_transformers_logits(tmp_path):
    hf, folder = mxfp4_folder(tmp_path)
    ours = xorl.models.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, hf(input_ids=ids).logits) < 1e-5
        xorl.models.save_pretrained(ours, str(tmp_path / "dense"))  # export: dense, interleaved
        back = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "dense", attn_implementation="eager")
        assert rel_err(back(input_ids=ids).logits, hf(input_ids=ids).logits) < 1e-5


def test_mxfp4_boxes_read_only_what_a_shard_holds(tmp_path):
    """An FSDP / EP shard's box (a range of experts, of in rows and of out columns) equals that box
    of the whole dequantised tensor, reading only the MXFP4 blocks around it."""
    from xorl.distributed.shard_box import ShardBox
    from xorl.models.hf_layout import FileNames, _plan
    from xorl.models.hf_reader import _SliceReader

    hf, folder = mxfp4_folder(tmp_path)
    ours = xorl.models.from_pretrained(str(folder), dtype=torch.float32)
    reader = _SliceReader(str(folder), FileNames(ours.spec))
    reads = []
    plain = reader.__call__

    def counting(key, index):
        out = plain(key, index)
        reads.append((key, out.numel()))
        return out

    name = "model.layers.1.mlp.experts.gate_up_proj"
    recipe = _plan([name, name + "_bias", "model.layers.1.mlp.experts.down_proj"], set(reader.file_of), False,
                   ours.spec)
    full = dict(ours.named_parameters())
    for target, offset, shape in ((name, (1, 33, 50), (3, 20, 40)), (name, (2, 0, 0), (2, 64, 128)),
                                  (name + "_bias", (2, 60), (2, 50)), (name + "_bias", (0, 10), (1, 100)),
                                  ("model.layers.1.mlp.experts.down_proj", (4, 0, 10), (1, 64, 30))):
        global_shape = tuple(full[target].shape)
        box = ShardBox(global_shape, offset, shape)
        dest = torch.full(shape, float("nan"))
        reads.clear()
        recipe[target].fill(counting, dest, box)
        assert torch.equal(dest, full[target].detach()[box.slices]), target
        if target.endswith("gate_up_proj") and shape[0] == 3:  # 3 experts x 40 out rows x blocks over in 33..52
            assert sum(n for k, n in reads if k.endswith("_blocks")) <= 3 * 41 * 2 * 16
        if target.endswith("gate_up_proj") and shape[0] == 2:  # whole experts: their blocks read once
            assert sum(n for k, n in reads if k.endswith("_blocks")) == 2 * 128 * 2 * 16
    reader.close()


def test_clamped_swiglu_matches_transformers_apply_gate():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from xorl_kernels.activation.op import clamped_swiglu

    config = transformers.GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=2, swiglu_limit=1.5,
                                       swiglu_alpha=1.3)
    # transformers 5.17 (the GPU image's) ignores the config's alpha and limit (1.702 and 7.0 always):
    # compare at the values it uses, with inputs scaled to cross the limit either way.
    alpha, limit = GptOssExperts(config).alpha, GptOssExperts(config).limit
    gate_up = 2 * limit * torch.randn(40, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ref = GptOssExperts(config)._apply_gate(gate_up.clone().requires_grad_(True))
    x = gate_up.clone().requires_grad_(True)
    out = clamped_swiglu(x[:, ::2], x[:, 1::2], alpha=alpha, limit=limit)
    assert (gate_up[:, ::2] > limit).any() and (gate_up[:, 1::2].abs() > limit).any()
    assert torch.allclose(out, ref, rtol=0, atol=1e-14)
    dy = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, dy)
    g = gate_up.clone().requires_grad_(True)
    (dref,) = torch.autograd.grad(GptOssExperts(config)._apply_gate(g), g, dy)
    assert rel_err(dx, dref) < 1e-13 and torch.equal(dx == 0, dref == 0)  # the same elements cut


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_clamped_swiglu_kernel_matches_float64(backend, dtype, interleaved):
    """The fused op (Triton under the interpreter on CPU, compiled on a GPU; and the reference) on
    the interleaved halves of a gate_up projection read in place, vs float64 autograd of the
    formula; inputs on the bf16 grid so both sides see the same values at the clamps."""
    from tests.unit.kernels.test_fused_elementwise import _check
    from xorl_kernels.activation.op import clamped_swiglu

    alpha, limit, units = 1.702, 1.5, 45

    def formula(g, u):
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        return (u + 1) * g * torch.sigmoid(alpha * g)

    gu = (torch.randn(3, 7, 2 * units, generator=torch.Generator().manual_seed(9)) * 2).bfloat16().float()
    assert (gu > limit).float().mean() > 0.1 and (gu < -limit).float().mean() > 0.1
    if interleaved:
        _check(lambda t, backend: clamped_swiglu(t[..., ::2], t[..., 1::2], alpha, limit, backend=backend),
               lambda t: formula(t[..., ::2], t[..., 1::2]), [gu], [(3, 7, units)], backend, dtype, 10)
    else:
        _check(lambda g, u, backend: clamped_swiglu(g, u, alpha, limit, backend=backend), formula,
               [gu[..., :units].contiguous(), gu[..., units:].contiguous()], [(3, 7, units)], backend, dtype, 11)


def test_router_with_bias_matches_gpt_oss_topk_router(tmp_path):
    hf = hf_checkpoint("gpt_oss", tmp_path / "hf", seed=6)
    ours = xorl.models.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(7))
    routed = ours.model.layers[0].mlp.gate(x)
    _, ref_weights, ref_ids = hf.model.layers[0].mlp.router(x)
    assert torch.equal(routed.expert_ids, ref_ids)
    assert rel_err(routed.weights, ref_weights) < 1e-6


def test_mxfp4_folder_starts_expert_parallel_ranks_reading_only_their_experts(gloo_world, tmp_path):
    """A trainer start from an MXFP4 folder on EP 2 x FSDP 2: every rank's experts are the
    dequantised tensors (transformers' convert_moe_packed_tensors, de-interleaved here), and each
    rank reads no more checkpoint elements than it holds (blocks and scales of its experts only)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.multirank.test_sharded_start import initial_state_dict, start_and_gather
    from tests.support.parity_runs import tiny_config
    from xorl.models.hf_writer import save_hf_weights

    source = tiny_config(str(tmp_path / "src"), "gpt_oss")
    source.train.seed = 11
    folder = tmp_path / "folder"
    save_hf_weights(initial_state_dict(source), str(folder), source.model)
    tensors = load_file(folder / "model.safetensors")
    expected = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out], interleaved
        expected[name] = torch.cat([dense[..., 0::2], dense[..., 1::2]], -1) if "gate_up" in name else dense
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    configs = []
    for sub, path in (("seeded", None), ("hf", str(folder))):
        config = tiny_config(str(tmp_path / sub), "gpt_oss", data_parallel_shard_size=2, expert_parallel_size=2)
        config.model.model_path, config.train.seed = path, 3
        configs.append(config)
    results = gloo_world(2).run(start_and_gather, *configs, timeout_s=600)
    loaded = results[0]["from_folder"]
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    assert torch.equal(loaded["model.layers.0.mlp.experts.gate_up_proj_bias"],
                       initial_state_dict(source)["model.layers.0.mlp.experts.gate_up_proj_bias"])
    for rank, r in enumerate(results):
        assert 0 < r["read"] < r["owned"], (rank, r)


def test_trainer_export_under_expert_parallelism_loads_in_transformers(gloo_world, tmp_path):
    """Train 2 steps on EP 2 x FSDP 2, export through the trainer (streamed from the gathered
    weights): transformers' GptOssForCausalLM loads the folder and gives the logits of an xorl model
    holding the trained weights."""
    from tests.multirank.test_export import train_and_export
    from tests.support.parity_runs import tiny_config
    from xorl.models.registry import build_model

    config = tiny_config(str(tmp_path / "run"), "gpt_oss", max_steps=2, data_parallel_shard_size=2,
                         expert_parallel_size=2)
    weights = gloo_world(2).run(train_and_export, config, str(tmp_path / "hf"))[0]
    ours = build_model(config.model)
    ours.load_state_dict(weights)
    hf = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                        dtype=torch.float32).eval()
    ids = torch.randint(0, config.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert rel_err(ours.eval()(ids).logits, hf(input_ids=ids).logits) < 1e-5
    assert torch.equal(hf.model.layers[1].self_attn.sinks, weights["model.layers.1.self_attn.sinks"])


@pytest.mark.parametrize("change, message", [
    (dict(fp8="blockwise"), "FP8 grouped GEMM takes none"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types must list"),
    (dict(sliding_window=None), "sliding_window is null"),
    (dict(model_type="qwen3_moe"), "only model_type gpt_oss reads it"),
])
def test_configs_xorl_cannot_run_are_refused_naming_the_field(change, message):
    from tests.support.parity_runs import tiny_config
    from xorl.config.errors import ConfigError
    from xorl.config.validate import validate_config

    config = tiny_config("/unused", "gpt_oss")
    for key, value in change.items():
        setattr(config.train if key == "fp8" else config.model, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(config, 1)


def test_new_custom_ops_pass_opcheck():
    """The grouped GEMM with a bias and the clamped SwiGLU trace under torch.compile (schema, fake
    and autograd registrations; tests/multirank/test_compile.py checks the other kernel ops the same way)."""
    import xorl_kernels.activation.op  # noqa: F401
    import xorl_kernels.expert_gemm.op  # noqa: F401

    ops = torch.ops.xorl
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    sizes = torch.tensor([3, 0, 4])
    torch.library.opcheck(ops.grouped_gemm_bias.default, (rand(7, 5), rand(3, 5, 6), rand(3, 6), sizes, None))
    torch.library.opcheck(ops.grouped_bias_grad.default, (torch.randn(7, 6), torch.randn(3, 6), sizes, None))
    gu = 3 * torch.randn(4, 10, generator=gen)
    torch.library.opcheck(ops.clamped_swiglu.default, (gu[:, ::2].requires_grad_(), gu[:, 1::2].requires_grad_(),
                                                       1.702, 1.5, None))
    torch.library.opcheck(ops.clamped_swiglu_backward.default, (torch.randn(4, 5), gu[:, ::2], gu[:, 1::2], 1.702,
                                                                1.5, None))


def test_flops_per_token_counts_the_keys_inside_each_window():
    """MFU's attention term: the (query, key) pairs each layer computes, counted one by one here."""
    from tests.support.parity_runs import tiny_config
    from xorl.observability.mfu import flops_per_token

    m = tiny_config("/unused", "gpt_oss").model  # windows of 8 on layers 0 and 2 of 4
    seq = 40
    pos = torch.arange(seq)
    causal = (pos[None, :] <= pos[:, None]).sum().item()
    windowed = ((pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 8)).sum().item()
    per_pair = 6 * m.num_attention_heads * 2 * (m.head_dim or m.hidden_size // m.num_attention_heads)
    full = dict(vars(m), sliding_window=None, layer_types=[])
    difference = flops_per_token(type("M", (), full)(), seq) - flops_per_token(m, seq)
    # The formula counts areas (a full causal layer: seq / 2 keys per query, the triangle); the exact
    # counts exceed them by the half diagonal: (seq + 1) / 2 and W - W^2 / (2 seq) + W / (2 seq).
    keys_full, keys_window = seq / 2, 8 - 64 / (2 * seq)
    assert difference == pytest.approx(2 * per_pair * (keys_full - keys_window), rel=1e-12)
    assert causal / seq - keys_full == pytest.approx(0.5)
    assert windowed / seq - keys_window == pytest.approx(8 / (2 * seq))


def compile_new_kernels_for_sm90() -> dict:
    """sm_90 compiles (no GPU needed) of the clamped SwiGLU (forward and backward) and the bias
    gradient kernels, as launched for bf16 tensors: the interpreter accepts code the GPU compiler
    rejects. Returns each kernel's shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from xorl_kernels.activation import triton_kernels as act
    from xorl_kernels.expert_gemm import triton_kernels as gg

    def build(kernel, constexprs, floats=()):
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = "*i32" if name == "sizes_ptr" else "*bf16"
            else:
                signature[name] = "fp32" if name in floats else "i32"
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4))
        return compiled.metadata.shared

    out = {}
    for backward in (False, True):
        out[f"clamped_swiglu backward={backward}"] = build(
            act._clamped_swiglu_kernel, {"BACKWARD": backward, "BLOCK": 1024}, floats=("alpha", "limit"))
    out["grouped_bias_grad"] = build(gg._grouped_bias_grad_kernel, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_G": 16})
    return out


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run for real")
def test_new_kernels_compile_for_h100():
    import json
    import os
    import subprocess
    import sys

    code = ("import json, tests.unit.models.test_gpt_oss as t\n"
            "try:\n    print(json.dumps(t.compile_new_kernels_for_sm90()))\n"
            "except (ImportError, TypeError) as e:\n    print('API', e); raise SystemExit(3)\n")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode == 3:
        pytest.skip(f"this triton's AOT compile API differs: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout.strip().splitlines()[-1])) == 3
