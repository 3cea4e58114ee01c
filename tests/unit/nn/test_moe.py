"""xorl.nn.MoE (one process): against transformers' Qwen3-MoE / Qwen2-MoE blocks on the same weights
(copied by tests/support/hf_moe_blocks.py) and against an independent float64 per-token loop, output
and every gradient."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_moe_blocks import OutputOnlyMoE, moe_from_block, replace_sparse_moe_blocks
from tests.support.moe_reference import tiny_qwen3_moe_config
from xorl.nn.moe import MoE


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def random_moe(seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    args = {"hidden_size": 32, "num_experts": 8, "top_k": 2, "moe_intermediate_size": 16, **kw}
    moe = MoE(**args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.3)
    return moe


def loop_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """float64 MoE written per token and per chosen expert; uses the module's weights (as float64
    leaves) so gradients can be compared."""
    w_gate = moe.gate.weight.detach().double().requires_grad_()
    experts = {
        n: getattr(moe.experts, n).detach().double().requires_grad_() for n in ("gate_up_proj", "down_proj")
    }
    gate, up = experts["gate_up_proj"].chunk(2, dim=2)  # [E, hidden, I] each
    x64 = x.detach().double().requires_grad_()
    probs = (x64 @ w_gate.t()).softmax(-1)
    outs = []
    for t in range(x64.shape[0]):
        top = probs[t].topk(moe.top_k).indices
        w = probs[t, top] / probs[t, top].sum()
        acc = torch.zeros_like(x64[t])
        for k, e in enumerate(top.tolist()):
            h = torch.nn.functional.silu(x64[t] @ gate[e]) * (x64[t] @ up[e])
            acc = acc + w[k] * (h @ experts["down_proj"][e])
        outs.append(acc)
    return torch.stack(outs), x64, w_gate, experts


def test_matches_float64_loop_output_and_gradients():
    moe = random_moe()
    x = torch.randn(3, 7, 32, requires_grad=True)
    out, _ = moe(x)
    assert out.shape == x.shape
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, x64, w_gate, experts = loop_reference(moe, x.reshape(-1, 32))
    ref.backward(grad.reshape(-1, 32).double())
    assert rel_err(out.reshape(-1, 32), ref) < 1e-5
    assert rel_err(x.grad.reshape(-1, 32), x64.grad) < 1e-5
    assert rel_err(moe.gate.weight.grad, w_gate.grad) < 1e-5
    for name, leaf in experts.items():
        assert rel_err(getattr(moe.experts, name).grad, leaf.grad) < 1e-5, name


def _hf_qwen3_block(seed=0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True
    )
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)
    return block


def test_matches_transformers_qwen3_moe_block():
    block = _hf_qwen3_block()
    moe = moe_from_block(block)
    assert (moe.num_experts, moe.top_k, moe.moe_intermediate_size) == (8, 2, 16)
    x = torch.randn(2, 9, 32)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, (out, _) = block(x_hf), moe(x_ours)
    assert out.shape == out_hf.shape
    assert rel_err(out, out_hf) < 1e-5
    grad = torch.randn_like(out)
    out_hf.backward(grad)
    out.backward(grad)
    inter = 16
    gate_up = block.experts.gate_up_proj.grad
    assert rel_err(x_ours.grad, x_hf.grad) < 1e-5
    assert rel_err(moe.gate.weight.grad, block.gate.weight.grad) < 1e-5
    assert rel_err(moe.experts.gate_up_proj.grad[:, :, :inter], gate_up[:, :inter].transpose(1, 2)) < 1e-5
    assert rel_err(moe.experts.gate_up_proj.grad[:, :, inter:], gate_up[:, inter:].transpose(1, 2)) < 1e-5
    assert rel_err(moe.experts.down_proj.grad, block.experts.down_proj.grad.transpose(1, 2)) < 1e-5


def test_shared_expert_matches_transformers_qwen2_moe_block():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(3)
    cfg = Qwen2MoeConfig(
        hidden_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        norm_topk_prob=False,
    )
    block = Qwen2MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)
    moe = moe_from_block(block)
    assert moe.shared_expert is not None and not moe.gate.norm_topk_prob
    x = torch.randn(2, 5, 32)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, (out, _) = block(x_hf), moe(x_ours)
    assert rel_err(out, out_hf) < 1e-5
    grad = torch.randn_like(out)
    out_hf.backward(grad)
    out.backward(grad)
    assert rel_err(x_ours.grad, x_hf.grad) < 1e-5
    assert rel_err(moe.shared_expert_gate.weight.grad, block.shared_expert_gate.weight.grad) < 1e-5
    assert rel_err(moe.shared_expert.up_proj.weight.grad, block.shared_expert.up_proj.weight.grad) < 1e-5


def test_xorl_blocks_in_a_transformers_model_keep_its_logits():
    """The converted blocks in place of a transformers model's own: the same logits; the EP plan (size 1)
    then finds them as xorl MoE blocks, and refuses the model before the conversion."""
    import transformers

    from xorl.parallel.expert_parallel import apply_expert_parallel

    torch.manual_seed(9)
    config = tiny_qwen3_moe_config(vocab_size=61, num_experts=4, attn_implementation="eager")
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    ids = torch.randint(0, 61, (2, 7))
    ref = hf(ids).logits
    with pytest.raises(ValueError, match="has no xorl.nn.MoE block"):
        apply_expert_parallel(hf, None)
    assert replace_sparse_moe_blocks(hf) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert isinstance(hf.model.layers[1].mlp, OutputOnlyMoE) and not hf.model.layers[1].mlp.training
    assert apply_expert_parallel(hf, None).blocks == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert rel_err(hf(ids).logits, ref) < 1e-5


def test_state_dict_names_layouts_and_aux_losses():
    moe = random_moe(seed=4, aux_loss_coef=0.01, z_loss_coef=0.001)
    sd = moe.state_dict()
    assert set(sd) == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    assert sd["gate.weight"].shape == (8, 32)
    assert sd["experts.gate_up_proj"].shape == (8, 32, 32)  # gate columns, then up
    assert sd["experts.down_proj"].shape == (8, 16, 32)
    other = random_moe(seed=5)
    other.load_state_dict(sd)
    x = torch.randn(11, 32)
    out, aux = moe(x)  # the auxiliary losses come back with the output (no module state)
    assert torch.equal(other(x)[0], out)

    stats = aux._asdict()
    assert stats["tokens_per_expert"].sum() == 11 * 2
    expected = 0.01 * stats["load_balancing_loss"] + 0.001 * stats["z_loss"]
    assert torch.allclose(aux.loss, expected)
    assert aux.loss.requires_grad
    assert not any(isinstance(v, torch.Tensor) for v in vars(moe).values())  # nothing kept on the module


def test_bf16_close_to_fp32():
    moe = random_moe(seed=7)
    x = torch.randn(16, 32)
    ref = moe(x)[0]
    out = moe.to(torch.bfloat16)(x.bfloat16())[0]
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 2e-2


def test_clear_errors():
    with pytest.raises(ValueError, match="top_k must be in"):
        MoE(16, 4, 5, 8)
    with pytest.raises(ValueError, match="last dim must be 16"):
        MoE(16, 4, 2, 8)(torch.randn(3, 8))
    with pytest.raises(ValueError, match="expected"):
        MoE(16, 4, 2, 8).load_experts(torch.randn(3, 16, 8), torch.randn(4, 16, 8), torch.randn(4, 8, 16))


@pytest.mark.gpu
def test_cuda_bf16_layer_matches_fp32_without_host_sync():
    moe = random_moe(seed=8, hidden_size=256, num_experts=16, top_k=4, moe_intermediate_size=128)
    x = torch.randn(512, 256)
    grad = torch.randn(512, 256)
    x_ref = x.clone().requires_grad_()
    ref = moe(x_ref)[0]
    ref.backward(grad)
    gpu = random_moe(seed=8, hidden_size=256, num_experts=16, top_k=4, moe_intermediate_size=128)
    gpu = gpu.cuda().to(torch.bfloat16)
    x_gpu = x.cuda().bfloat16().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the EP=1 layer must never wait on the device
    try:
        out = gpu(x_gpu)[0]
        out.backward(grad.cuda().bfloat16())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(out.float().cpu(), ref) < 3e-2
    assert rel_err(x_gpu.grad.float().cpu(), x_ref.grad) < 3e-2
    assert rel_err(gpu.experts.down_proj.grad.float().cpu(), moe.experts.down_proj.grad) < 3e-2


def test_experts_run_gate_and_up_as_one_grouped_gemm():
    """Two grouped GEMMs per expert pass (gate and up fused, then down), and two in backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountGroupedGemms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "xorl" and func._opname.startswith("grouped_gemm"):
                self.calls.append(func._opname)
            return func(*args, **(kwargs or {}))

    moe = random_moe(seed=6)
    x = torch.randn(13, 32, requires_grad=True)
    with CountGroupedGemms() as forward:
        out = moe(x)[0]
    with CountGroupedGemms() as backward:
        out.backward(torch.randn_like(out))
    assert forward.calls == ["grouped_gemm", "grouped_gemm"], forward.calls
    assert backward.calls == ["grouped_gemm_backward", "grouped_gemm_backward"], backward.calls
    assert moe.experts.gate_up_proj.grad.abs().sum() > 0


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3", "mixtral", "gpt_oss"])
def test_mfu_counts_the_matmul_weights_each_token_passes_through(model):
    """xorl/observability/mfu.py's 6 N term against the built model's own weights (every matrix but the embedding
    lookup and biases; routed experts at top-k / num_experts): dense first layers (GLM, DeepSeek) at
    their intermediate_size, the shared expert (and Qwen2-MoE's shared_expert_gate) on every MoE
    layer. Before, every layer was counted as top-k routed experts alone: Qwen2-57B-A14B's MFU
    left out its 20480-wide shared expert, half of its MLP FLOPs, and a Mixtral YAML's experts were
    counted moe_intermediate_size wide (a field Mixtral does not read): examples/mixtral_8x7b's MFU
    was 6.4x too low (12.4 instead of 79.7 GFLOP a token)."""
    from tests.support.parity_runs import tiny_config
    from xorl.config import ModelConfig
    from xorl.models.registry import build_model
    from xorl.observability.mfu import flops_per_token

    # Mixtral as a YAML writes it (examples/mixtral_8x7b_*.yaml): experts as wide as intermediate_size,
    # moe_intermediate_size left at its default (64), which Mixtral does not read
    extra = {"qwen2_moe": dict(model_type="qwen2_moe", shared_expert_intermediate_size=48, mlp_only_layers=[1]),
             "mixtral": dict(intermediate_size=96, moe_intermediate_size=ModelConfig().moe_intermediate_size)}
    config = tiny_config("/unused", "qwen3_moe" if model == "qwen2_moe" else model).model
    for key, value in extra.get(model, {}).items():
        setattr(config, key, value)
    config.sliding_window, config.layer_types = None, []  # gpt-oss: windows change the score FLOPs only
    with torch.device("meta"):
        built = build_model(config)
    share = config.num_experts_per_tok / config.num_experts
    per_token = sum(p.numel() * (share if ".experts." in n else 1.0) for n, p in built.named_parameters()
                    if p.ndim >= 2 and "embed_tokens" not in n and "bias" not in n)
    dense_layers = sum(".mlp.gate_proj." in n for n, _ in built.named_parameters())
    assert dense_layers == {"qwen2_moe": 1, "glm4_moe": 1, "deepseek_v3": 1}.get(model, 0)  # the rows under test
    # seq_len 0: no attention-score FLOPs, the 6 N term alone
    assert flops_per_token(config, 0) == pytest.approx(6 * per_token, rel=1e-12)


@pytest.mark.parametrize("field", ["router_aux_loss_coef", "router_z_loss_coef"])
def test_a_negative_router_loss_weight_is_refused_naming_the_field(field, tmp_path):
    """A negative weight rewards imbalance; it used to train without a word. Refused before any
    process group starts (validate_config), naming the field; 0 (off) and a positive weight pass."""
    from xorl.config import load_config
    from xorl.config.errors import ConfigError
    from xorl.config.validate import validate_config

    def config(value):
        return load_config(None, ["--model.model_type=qwen3_moe", "--model.num_experts=4",
                                  f"--model.{field}={value}", f"--train.output_dir={tmp_path}"])

    with pytest.raises(ConfigError, match=f"model.{field}=-0.01 must be >= 0"):
        validate_config(config(-0.01), world_size=1)
    for value in (0.0, 0.01):
        validate_config(config(value), world_size=1)


@pytest.mark.parametrize("model, fp8", [("qwen2_moe", "rowwise"), ("qwen3_moe", "blockwise"), ("gpt_oss", "none"),
                                        ("llama", "tensorwise")])
def test_start_up_line_says_active_parameters_and_which_gemms_run_in_fp8(model, fp8):
    """The model line a user reads: an MoE model's parameters a token passes through (counted here
    from the built model: every weight but the routed experts' (num_experts - top_k) / num_experts),
    and with train.fp8 which GEMMs the built model runs in FP8 (the modules' own fp8 attribute): with
    tensorwise / rowwise the routed experts stay in train.dtype, which the line used not to say (it
    did not mention FP8 at all)."""
    from tests.support.parity_runs import tiny_config
    from xorl.distributed.parallel_config import ParallelConfig
    from xorl.models.registry import build_model
    from xorl.observability.metrics import startup_summary

    config = tiny_config("/unused", "qwen3_moe" if model == "qwen2_moe" else model, fp8=fp8)
    m = config.model
    if model == "qwen2_moe":
        m.model_type, m.shared_expert_intermediate_size = "qwen2_moe", 48
    with torch.device("meta"):
        built = build_model(m, fp8=fp8)
    total = sum(p.numel() for p in built.parameters())
    line = startup_summary(config, ParallelConfig.from_config(config, 1), total, 0, "cpu").splitlines()[0]
    if m.num_experts:
        routed = sum(p.numel() for n, p in built.named_parameters() if ".experts." in n)
        active = total - routed * (1 - m.num_experts_per_tok / m.num_experts)
        assert f"({active / 1e6:.2f}M active a token)" in line if active >= 1e4 else f"({round(active)} active" in line
    else:
        assert "active" not in line
    if fp8 == "none":
        assert "FP8" not in line
        return
    fp8_modules = {n.rsplit(".", 1)[-1] for n, mod in built.named_modules() if getattr(mod, "fp8", "none") == fp8}
    assert {"q_proj", "o_proj"} <= fp8_modules and f"FP8 {fp8} GEMMs in the attention" in line
    experts = [mod for n, mod in built.named_modules() if n.endswith(".experts")]
    experts_fp8 = any(getattr(mod, "fp8", "none") == "blockwise" for mod in experts)
    if experts:
        assert ("and the routed experts" in line) == experts_fp8
        assert ("the routed experts in float32" in line) == (not experts_fp8)
    shared = [n for n, mod in built.named_modules() if ".shared_expert." in n and getattr(mod, "fp8", "none") != "none"]
    assert not shared and ("shared expert in float32" in line) == bool(m.num_experts)


def test_a_bad_moe_folder_is_refused_in_its_own_config_json_keys(tmp_path):
    """A transformers-saved Mixtral / DeepSeek-V2 folder whose config.json has num_experts_per_tok >
    the experts: one message per problem naming the file and its own keys (num_local_experts,
    n_routed_experts; xorl's num_experts is not in the file), before any process group starts. And
    expert_parallel_size not dividing the experts names the sizes that do."""
    import json

    import transformers

    from xorl.config import load_config
    from xorl.config.errors import ConfigError
    from xorl.config.validate import validate_config

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2)
    folders = {"mixtral": (transformers.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2),
                           "MixtralForCausalLM", "num_local_experts=4"),
               "deepseek_v2": (transformers.DeepseekV2Config(**small, n_routed_experts=6, num_experts_per_tok=2,
                                                             moe_intermediate_size=16, kv_lora_rank=8, q_lora_rank=None,
                                                             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                                             topk_method="greedy", n_group=1, topk_group=1),
                               "DeepseekV2ForCausalLM", "n_routed_experts=6")}
    for name, (hf_config, cls, experts) in folders.items():
        folder = tmp_path / name
        getattr(transformers, cls)(hf_config).save_pretrained(folder)
        raw = json.loads((folder / "config.json").read_text())
        raw["num_experts_per_tok"] = 7
        (folder / "config.json").write_text(json.dumps(raw))
        config = load_config(None, [f"--model.model_path={folder}", f"--train.output_dir={tmp_path / 'out'}"])
        with pytest.raises(ConfigError) as err:
            validate_config(config, world_size=1)
        assert f"({folder}/config.json has num_experts_per_tok=7, {experts}: correct the folder's config.json)" \
            in str(err.value)
    raw["num_experts_per_tok"] = 2
    (folder / "config.json").write_text(json.dumps(raw))
    config = load_config(None, [f"--model.model_path={folder}", "--train.expert_parallel_size=4",
                                f"--train.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError, match=r"num_experts=6 must be a multiple of train.expert_parallel_size=4 .*"
                                          r"use expert_parallel_size one of \[1, 2\]"):
        validate_config(config, world_size=4)


# Fields whose absence from config.json makes the weights' shapes disagree (the weight loader refuses
# those); the rest change the model silently, so a missing key must mean what it means in transformers.
_SHAPE_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                 "shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "attention_bias", "first_k_dense_replace"}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss",
                                        "deepseek_v3", "deepseek_v2"])
def test_a_key_config_json_leaves_out_means_what_transformers_reads(model_type, tmp_path):
    """For each scalar key of a transformers-saved config.json that does not set a weight shape
    (top-k, norm eps, RoPE theta, norm_topk_prob, groups, sliding window, ...): a copy without it
    gives xorl the value transformers' own config class reads from that copy. Before, xorl took its
    own schema default: a Qwen3-MoE file without num_experts_per_tok trained top-2 where
    transformers runs top-8, a Mixtral file without rms_norm_eps used 1e-6 for 1e-5."""
    import json

    import transformers

    from xorl.models.families import family
    from xorl.models.pretrained import model_config_from_folder
    from xorl.models.schema import FIELDS

    fam = family(model_type)
    hf_config = transformers.AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, num_hidden_layers=4,
                                                  num_attention_heads=2, num_key_value_heads=2)
    folder = tmp_path / "full"
    hf_config.save_pretrained(folder)
    full = json.loads((folder / "config.json").read_text())
    checked = 0
    for f in FIELDS:
        keys = [k for k in fam.hf_keys(f.name) if k in full]
        if (f.kind == "local" or not fam.carries(f.name) or f.name in fam.fixed or f.name in _SHAPE_FIELDS
                or not keys or isinstance(full[keys[0]], (list, dict)) or f.name in fam.derived):
            continue
        cut = tmp_path / f.name
        cut.mkdir()
        (cut / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k not in keys}))
        try:
            expected = getattr(transformers.AutoConfig.from_pretrained(cut), keys[0])
        except ValueError:  # transformers' own validation needs the key (e.g. layer_types' length)
            continue
        if expected is None:  # transformers has no default either (DeepSeek-V2's num_experts_per_tok)
            continue
        got = getattr(model_config_from_folder(str(cut)), f.name)
        assert got == expected, f"{model_type} without {keys[0]}: xorl {f.name}={got!r}, transformers {expected!r}"
        checked += 1
    if "rope_parameters" in full or "rope_theta" in full:  # v5 keeps theta in rope_parameters
        cut = tmp_path / "rope_theta"
        cut.mkdir()
        raw = {k: v for k, v in full.items() if k != "rope_theta"}
        raw["rope_parameters"] = {k: v for k, v in (raw.get("rope_parameters") or {}).items() if k != "rope_theta"}
        (cut / "config.json").write_text(json.dumps(raw))
        expected = transformers.AutoConfig.from_pretrained(cut).rope_parameters["rope_theta"]
        assert model_config_from_folder(str(cut)).rope_theta == expected, f"{model_type} without rope_theta"
    assert checked >= 3


def test_xorl_export_refuses_a_model_its_family_class_cannot_hold_in_one_line(tmp_path, capsys):
    """A Qwen3-MoE folder trained with --model.router_scoring=sigmoid (a local field the trainer
    allows without export_hf): xorl-export said so in a ValueError traceback from inside the export.
    Now one 'xorl-export: ...' line naming the field, exit 2, before any tensor is read (this
    checkpoint holds no tensors at all) and with no output folder left."""
    import dataclasses
    import json

    from tests.support.parity_runs import tiny_config
    from xorl.checkpoint.state import MODEL_CONFIG
    from xorl.cli.export import main as xorl_export
    from xorl.models.spec import EXPERTS_LAYOUT

    model = tiny_config("/unused", "qwen3_moe").model
    model.router_scoring = "sigmoid"
    checkpoint = tmp_path / "step_00000001"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(b"")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 1, "experts_layout": EXPERTS_LAYOUT}))
    (checkpoint / MODEL_CONFIG).write_text(json.dumps(dataclasses.asdict(model)))
    assert xorl_export([str(checkpoint), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xorl-export: router_scoring='sigmoid' has no Qwen3MoeForCausalLM equivalent")
    assert "Traceback" not in err and err.count("\n") == 1 and not (tmp_path / "hf").exists()
    model.router_scoring = "softmax"  # the family's own router: past the check (to the empty .metadata)
    (checkpoint / MODEL_CONFIG).write_text(json.dumps(dataclasses.asdict(model)))
    with pytest.raises(Exception) as other:
        xorl_export([str(checkpoint), str(tmp_path / "hf2")])
    assert "router_scoring" not in str(other.value)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_expert_load_metric_is_the_busiest_expert_over_the_mean_from_transformers_routing(model_type, tmp_path):
    """metrics.jsonl's expert_load (parallel/step_reductions.step_router_loads): max over the MoE layers
    of the busiest expert's tokens / the mean expert's, counted by the routers in the step's training
    forwards (two here). Reference: transformers' own model on the same folder and tokens, its
    router_logits' top-k per layer. The counts start again after each report, and a model in eval
    mode counts nothing."""
    import transformers

    import xorl.models
    from xorl.parallel.step_reductions import step_router_loads

    torch.manual_seed(0)
    small = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=2, num_experts_per_tok=2, output_router_logits=True)
    config = (transformers.Qwen3MoeConfig(**small, num_experts=8, moe_intermediate_size=16, head_dim=16)
              if model_type == "qwen3_moe" else transformers.MixtralConfig(**small, num_local_experts=6))
    classes = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
    hf = getattr(transformers, classes[model_type])(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)  # routers far from uniform: an uneven load to measure
    hf.save_pretrained(tmp_path)
    ours = xorl.models.from_pretrained(str(tmp_path), dtype=torch.float32).train()
    batches = [torch.randint(0, 96, (1, 40)) for _ in range(2)]
    counts = 0
    for ids in batches:
        ours(ids)
        with torch.no_grad():
            logits = hf(ids).router_logits  # one [tokens, E] per layer
        counts = counts + torch.stack([torch.nn.functional.one_hot(layer.topk(2, dim=-1).indices,
                                                                    layer.shape[-1]).sum((0, 1)) for layer in logits])
    expected = (counts.double().amax(1) / counts.double().mean(1)).amax()
    got = step_router_loads([ours], group=None)
    assert expected > 1.2 and float(got) == pytest.approx(float(expected), rel=1e-12)
    assert float(step_router_loads([ours], group=None)) == 0  # reported, so counted afresh
    ours.eval()
    ours(batches[0])
    assert float(step_router_loads([ours], group=None)) == 0
