"""LoRA (model.lora, xorl/nn/lora.py): config rules, the frozen base, the optimizer state, and the
round trip through peft and through the merged export against transformers' own model classes.

The runs train a tiny Llama (every projection adapted) under FSDP 2 and a tiny Qwen3-MoE
(attention and per-expert adapters, the router frozen) under EP 2 x FSDP 2, with peft's ``init_lora_weights=false``
(B drawn too) so the adapter changes the logits from step 1 on. After training, every rank checks
that no frozen parameter has a gradient after a forward/backward and that its optimizer holds
state for exactly its adapter shards (the bytes counted); rank 0 returns the trained model's logits
on fresh random tokens. transformers + peft on the base folder and the saved adapter, and
transformers alone on the merged export, must give those logits to 1e-5 (fp32).
"""

from __future__ import annotations

import filecmp
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.support.parity_runs import tiny_config
from tests.support.paths import REPO_ROOT
from xorl.config import Config, ConfigError, validate_config

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(rank=4, alpha=8, dropout=0.0, init_lora_weights=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def train_and_check(config, base_folder: str, tokens: torch.Tensor) -> dict:
    """On every rank: train, check frozen grads and optimizer state, save the base, export merged."""
    from xorl.models.hf_writer import save_hf_weights
    from xorl.nn.lora import is_adapter_name
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    for name, module in trainer.model.named_modules():  # peft's initialisation, also over a loaded base
        if getattr(module, "lora", None) is not None:
            a, bound = _local(module.lora_A), module.in_features ** -0.5
            assert a.numel() == 0 or (0 < a.abs().max() <= bound and a.std() > bound / 3), name
    trainer.train()
    params = dict(trainer.model.named_parameters())
    adapters = {n: p for n, p in params.items() if is_adapter_name(n)}
    base = {n: p for n, p in params.items() if not is_adapter_name(n)}
    assert adapters and base and all(p.requires_grad for p in adapters.values())
    assert not any(p.requires_grad for p in base.values()), [n for n, p in base.items() if p.requires_grad]
    # Optimizer state: exactly the adapters' shards, exp_avg + exp_avg_sq each as large as the shard.
    optimizer = trainer.optimizers[0]
    held = {id(p) for p in optimizer.state}
    assert held == {id(p) for p in adapters.values()}
    state_bytes = sum(_nbytes(v) for s in optimizer.state.values() for k, v in s.items() if k != "step")
    assert state_bytes == 2 * sum(_nbytes(p) for p in adapters.values())
    # A forward/backward reaches the adapters only.
    out = trainer.model(tokens, labels=tokens.roll(-1, dims=1))
    out.loss.backward()
    assert all(p.grad is None for p in base.values())
    assert all(p.grad is not None and _local(p.grad).abs().sum() > 0 for p in adapters.values())
    optimizer.zero_grad(set_to_none=True)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(tokens).logits
    if not config.model.model_path:  # a seeded base: write it (the base alone; a collective)
        save_hf_weights(trainer.model, base_folder, config.model)
    trainer.export_hf(os.path.join(config.train.output_dir, "hf"))  # merged
    return {"logits": logits, "state_bytes": state_bytes} if dist.get_rank() == 0 else {}


RUNS = {  # the Llama fine-tunes a base read from an HF folder (model.model_path); the MoE a seeded one
    "llama, every projection, fsdp2": ("llama", ALL_PROJECTIONS, dict(data_parallel_shard_size=2)),
    "qwen3_moe, attention and experts, ep2 x fsdp2": ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj", "experts"],
                                                      dict(data_parallel_shard_size=2, expert_parallel_size=2)),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_adapter_loads_in_peft_and_merged_export_in_transformers(name, gloo_world, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model_type, targets, train = RUNS[name]
    config = tiny_config(str(tmp_path / "run"), model_type, max_steps=3, **train)
    config.train.save_steps = 2  # a checkpoint before the last, for `xorl-export --adapter` below
    base_folder = str(tmp_path / "base")
    if model_type == "llama":
        from xorl.models.pretrained import save_pretrained
        from xorl.models.registry import build_model

        save_pretrained(build_model(config.model), base_folder)  # a pretrained base, before LoRA is set
        config.model.model_path = base_folder
    config.model.lora = dict(LORA, target_modules=targets)
    tokens = torch.randint(0, config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    got = gloo_world(2).run(train_and_check, config, base_folder, tokens)[0]
    assert got["state_bytes"] > 0

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    hf = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = hf(tokens).logits
    assert rel(got["logits"], base_logits) > 1e-2  # the adapter matters: the comparison below is not vacuous
    adapted = peft.PeftModel.from_pretrained(hf, str(tmp_path / "run" / "adapter")).eval()
    with torch.no_grad():
        assert rel(got["logits"], adapted(tokens).logits) <= 1e-5
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel(got["logits"], merged(tokens).logits) <= 1e-5
    # xorl-export (one CPU process, the config from the checkpoint) merges the same way.
    from xorl.cli.export import main as xorl_export

    cli = str(tmp_path / "cli")
    assert xorl_export([str(tmp_path / "run"), cli]) == 0
    names = sorted(os.listdir(tmp_path / "run" / "hf"))
    assert sorted(os.listdir(cli)) == names
    assert filecmp.cmpfiles(tmp_path / "run" / "hf", cli, names, shallow=False)[0] == names
    # `xorl-export --adapter`: the latest checkpoint's adapter is the run's own adapter folder, tensor for tensor;
    # an earlier checkpoint's, loaded by peft, gives what transformers gives on that checkpoint's merged export.
    from safetensors.torch import load_file

    latest = str(tmp_path / "adapter_latest")
    assert xorl_export([str(tmp_path / "run"), latest, "--adapter"]) == 0
    ours, run = (load_file(os.path.join(folder, "adapter_model.safetensors"))
                 for folder in (latest, tmp_path / "run" / "adapter"))
    assert sorted(ours) == sorted(run) and all(torch.equal(ours[k], run[k]) for k in run)
    step2 = str(tmp_path / "run" / "checkpoints" / "step_00000002")
    assert xorl_export([step2, str(tmp_path / "adapter2"), "--adapter"]) == 0
    assert xorl_export([step2, str(tmp_path / "merged2")]) == 0
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32).eval()
    merged2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged2", dtype=torch.float32).eval()
    with torch.no_grad():
        reference = merged2(tokens).logits
        assert rel(reference, got["logits"]) > 1e-4  # step 2 is not the last step: a different adapter
        assert rel(peft.PeftModel.from_pretrained(hf2, str(tmp_path / "adapter2")).eval()(tokens).logits,
                   reference) <= 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe"])
def test_expert_adapters_match_peft_target_parameters(family, tmp_path):
    """The experts' adapters alone (one process), for every family of EXPERT_LORA_FAMILIES: peft's
    target_parameters on transformers' stacked experts give xorl's logits, and the adapters change
    them (B drawn). Qwen2-MoE with its shared expert (not adapted), GLM-4.5 with its dense first layer."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from xorl.checkpoint.peft_adapter import save_adapter
    from xorl.models.pretrained import save_pretrained
    from xorl.models.registry import build_model
    from xorl.nn.lora import EXPERT_LORA_FAMILIES

    assert family in EXPERT_LORA_FAMILIES
    config = tiny_config(str(tmp_path), "qwen3_moe" if family == "qwen2_moe" else family)
    if family == "qwen2_moe":
        config.model.model_type, config.model.shared_expert_intermediate_size = "qwen2_moe", 16
    config.model.lora = dict(LORA, target_modules=["experts"])
    validate_config(config, 1)
    model = build_model(config.model)
    model.init_weights(seed=11)
    save_pretrained(model, str(tmp_path / "base"))
    save_adapter([model], config.model, str(tmp_path / "adapter"))
    tokens = torch.randint(0, config.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model(tokens).logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        base = hf(tokens).logits
        theirs = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()(tokens).logits
    assert float((ours - base).norm() / base.norm()) > 1e-2
    assert float((ours - theirs).norm() / theirs.norm()) <= 1e-5


def _problems(**lora) -> str:
    config = Config()
    config.model.lora = lora
    with pytest.raises(ConfigError) as err:
        validate_config(config, 1)
    return str(err.value)


def test_config_rules_name_the_field_and_the_fix():
    assert "model.lora.rank=0 must be an integer >= 1" in _problems(rank=0, target_modules=["q_proj"])
    message = _problems(rank=4, target_modules=["q_proj", "qproj"])
    assert "['qproj'] are not module names" in message and "'down_proj'" in message
    assert "dropout=1.0 must be in [0, 1)" in _problems(rank=4, dropout=1.0, target_modules=["q_proj"])
    assert "['experts'] are not module names" in _problems(rank=4, target_modules=["experts"])  # a dense model
    assert "give rank and target_modules" in _problems(rank=4)
    config = Config()
    config.model.model_type, config.model.lora = "deepseek_v3", dict(rank=4, target_modules=["q_proj"])
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        validate_config(config, 1)
    config = Config()
    config.model.lora = dict(rank=4, target_modules=["q_proj"])
    config.model.merge_qkv = True
    with pytest.raises(ConfigError, match="set merge_qkv: false"):
        validate_config(config, 1)
    config.model.merge_qkv = False
    validate_config(config, 1)  # a valid LoRA config passes


def test_adapter_initialisation_is_peft_s_and_the_same_on_every_layout():
    """A uniform in +-1/sqrt(in) and B zero (peft's default); the numbers depend on the seed and name only."""
    from xorl.models.registry import build_model

    config = Config()
    config.model.lora = dict(rank=4, target_modules=["q_proj", "down_proj"])
    model = build_model(config.model)
    q = model.model.layers[0].self_attn.q_proj
    bound = 1 / q.in_features**0.5
    assert q.lora_A.abs().max() <= bound and q.lora_A.abs().max() > 0.9 * bound and q.lora_A.std() > bound / 3
    assert torch.count_nonzero(q.lora_B) == 0 and not q.weight.requires_grad
    assert model.model.layers[0].self_attn.k_proj.lora is None
    again = build_model(config.model)
    model.init_weights(seed=3)
    again.init_weights(seed=3)
    assert torch.equal(model.model.layers[1].mlp.down_proj.lora_A, again.model.layers[1].mlp.down_proj.lora_A)
    moe = tiny_config("", "qwen3_moe").model  # no dense MLP layer: gate_proj would adapt nothing
    moe.lora = dict(rank=2, target_modules=["q_proj", "gate_proj"])
    with pytest.raises(ValueError, match=r"\['gate_proj'\]: no module of this model takes a LoRA adapter"):
        build_model(moe)


# -- the planner's LoRA term (xorl/planner/shapes.py) against the real sharded model ---------------
PLAN_LAYOUTS = [  # (model fields, train fields) on 4 ranks; odd sizes so FSDP chunks unevenly
    ({}, {"data_parallel_shard_size": 4}),
    ({}, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    ({}, {"data_parallel_shard_size": 2, "tensor_parallel_size": 2, "dtype": "bfloat16"}),  # the base in bf16
    ({}, {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2, "tensor_parallel_size": 2}),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
      "mlp_only_layers": [0], "lora": {"rank": 3, "alpha": 6, "target_modules": [*ALL_PROJECTIONS, "experts"]}},
     {"expert_parallel_size": 2}),
]


def _plan_config(model: dict, train: dict) -> Config:
    base = {"vocab_size": 276, "hidden_size": 40, "intermediate_size": 72, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "lora": {"rank": 3, "alpha": 6, "target_modules": ALL_PROJECTIONS}}
    config = Config.from_dict({"model": {**base, **model}, "data": {"seq_len": 16}, "train": train})
    config.validate(4)
    return config


def _plan_probe_main() -> None:
    """Subprocess: the trainer's parallel model on the meta device under the fake process group, each
    rank in turn; its local element counts and the real optimizer's state bytes after one step."""
    import json
    import sys

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from xorl.config import compute_dtype
    from xorl.distributed.parallel_config import ParallelConfig
    from xorl.distributed.parallel_state import init_parallel_state
    from xorl.models.registry import build_model
    from xorl.nn.lora import cast_frozen_, frozen_dtype
    from xorl.parallel.parallelize import parallelize_model
    from xorl.parallel.pipeline_parallel import split_into_stages
    from xorl.trainer.optim import build_optimizer

    results = []
    for config_dict in json.load(sys.stdin):
        config = Config.from_dict(config_dict)
        for rank in range(4):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
            try:
                state = init_parallel_state(ParallelConfig.from_config(config, 4), device_type="cpu")
                with torch.device("meta"):
                    model = build_model(config.model)
                frozen = frozen_dtype(config.model.lora, compute_dtype(config.train, "cuda"))
                if frozen is not None:  # as the trainer does on a GPU
                    cast_frozen_(model, frozen)
                stages = split_into_stages(model, state, config).stages if state.pp_size > 1 else [model]
                parts = [parallelize_model(stage, state, config).module for stage in stages]
                params = [p for part in parts for p in part.parameters()]
                optimizers = [build_optimizer(part.parameters(), config.train)[0] for part in parts]
                for p in params:
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
                for optimizer in optimizers:
                    optimizer.step()
                results.append({
                    "rank": rank, "pp_rank": state.pp_rank, "shard_rank": state.dp_shard_cp_rank,
                    "numel": sum(_local(p).numel() for p in params),
                    "param_bytes": sum(_nbytes(p) for p in params),
                    "trainable": sum(_local(p).numel() for p in params if p.requires_grad),
                    "optimizer_bytes": sum(_nbytes(v) for o in optimizers for s in o.state.values()
                                           for k, v in s.items() if k != "step")})
            finally:
                dist.destroy_process_group()
    json.dump(results, sys.stdout)


@pytest.mark.slow  # ~9 s (real optimizer steps on five layouts' shapes): the full suite's, not the quick tier's
def test_planner_counts_the_frozen_base_and_the_adapters_state_exactly():
    """xorl-plan's params / grads / optimizer bytes of a LoRA run equal the sharded model's on every
    rank: weights for every local element, gradients and AdamW moments for the adapters' alone."""
    import json
    import subprocess
    import sys

    from xorl.distributed.parallel_config import ParallelConfig
    from xorl.planner.memory import estimate
    from xorl.planner.shapes import model_shapes, rank_params

    configs = [_plan_config(m, t) for m, t in PLAN_LAYOUTS]
    probe = "from tests.unit.nn.test_lora import _plan_probe_main; _plan_probe_main()"
    proc = subprocess.run([sys.executable, "-c", probe],
                          input=json.dumps([c.to_dict() for c in configs]), capture_output=True, text=True,
                          timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    measured = json.loads(proc.stdout)
    assert sum(r["param_bytes"] < 4 * r["numel"] for r in measured) == 4  # the bf16 layout's ranks
    for i, config in enumerate(configs):
        p, t = ParallelConfig.from_config(config, 4), config.train
        shapes = model_shapes(config.model)
        for got in measured[4 * i: 4 * i + 4]:
            rp = rank_params(shapes, p, t.pipeline_parallel_schedule, t.virtual_pipeline_stages, got["pp_rank"],
                             t.data_parallel_mode == "fsdp2", got["shard_rank"])
            assert (rp.local, rp.trainable) == (got["numel"], got["trainable"]), (PLAN_LAYOUTS[i], got)
            assert 0 < got["trainable"] < got["numel"] / 5
            assert 8 * rp.trainable == got["optimizer_bytes"]
            if got["shard_rank"] == 0:
                memory = estimate(config, p, shapes, got["pp_rank"], "fp32-master")
                assert (memory.params, memory.grads, memory.optimizer) == (
                    got["param_bytes"], 4 * got["trainable"], got["optimizer_bytes"])


def test_resume_continues_the_adapters_and_their_optimizer_state_exactly(gloo_world, tmp_path):
    """Stopped after step 3 and resumed (the same FSDP 2 layout, and from a TP 2 + SP save into FSDP 2):
    the losses of steps 4-6 are those of the uninterrupted run (bitwise in the same layout), so the
    adapters and their AdamW moments came back; the base stayed frozen and the run folder's adapter
    is the last step's."""
    from tests.support.parity_runs import train_losses

    fsdp2 = dict(data_parallel_shard_size=2, gradient_accumulation_steps=2)
    tp2 = dict(data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True,
               gradient_accumulation_steps=4)
    world = gloo_world(2)
    full = world.run(train_losses, tiny_config(str(tmp_path / "full"), "llama-lora", max_steps=6, **fsdp2))[0]
    assert full[-1] < full[0]
    for name, first_layout in (("same", fsdp2), ("from tp", tp2)):
        run = str(tmp_path / name)
        first = world.run(train_losses, tiny_config(run, "llama-lora", max_steps=6, save_steps=3, **first_layout),
                          3)[0]
        resumed = world.run(train_losses, tiny_config(run, "llama-lora", max_steps=6, resume=True, **fsdp2))[0]
        if name == "same":
            assert first + resumed == full
        else:
            assert max(abs(a - b) / b for a, b in zip(first + resumed, full)) <= 1e-5
        from safetensors.torch import load_file

        adapter = load_file(os.path.join(run, "adapter", "adapter_model.safetensors"))
        assert len(adapter) == 2 * 7 * 4  # A and B of 7 projections in each of 4 layers


def test_linear_with_dropout_is_peft_s_lora_layer():
    """xorl.nn.Linear(lora=...) against peft's lora.Linear on the same weights, in float64: training
    mode with the same seed (dropout on the adapter's input only, one draw) and eval mode."""
    peft = pytest.importorskip("peft")
    from xorl.nn.linear import Linear
    from xorl.nn.lora import LoRASpec

    torch.manual_seed(0)
    ours = Linear(24, 40, bias=True, lora=LoRASpec(rank=4, alpha=12, dropout=0.3, init_lora_weights=False)).double()
    base = torch.nn.Linear(24, 40, bias=True).double()
    base.load_state_dict({"weight": ours.weight, "bias": ours.bias})
    config = peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.3)
    theirs = peft.tuners.lora.Linear(base, "default", config=config, r=4, lora_alpha=12, lora_dropout=0.3).double()
    theirs.lora_A["default"].weight.data.copy_(ours.lora_A)
    theirs.lora_B["default"].weight.data.copy_(ours.lora_B)
    x = torch.randn(3, 7, 24, dtype=torch.float64)
    for training in (True, False):
        ours.train(training)
        theirs.train(training)
        torch.manual_seed(42)
        got = ours(x)
        torch.manual_seed(42)
        want = theirs(x)
        assert float((got - want).norm() / want.norm()) <= 1e-12, training
    ours.train()
    torch.manual_seed(42)
    assert not torch.allclose(ours(x), theirs.eval()(x))  # dropout acts in training mode
    got = ours(x)
    got.sum().backward()
    assert ours.weight.grad is None and ours.bias.grad is None and ours.lora_A.grad is not None


@pytest.mark.parametrize("model_type, targets", [("llama", ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
                                                 ("qwen3_moe", ["k_proj", "experts"])])
def test_mfu_flops_count_frozen_weights_without_their_weight_gradient(model_type, targets):
    """xorl/observability/mfu.py with LoRA: frozen base matmuls 4 FLOPs per weight (forward + input
    gradient), adapters 6, an expert's adapters only for the top-k tokens routed to it; counted here from the
    built model."""
    from xorl.models.registry import build_model
    from xorl.observability.mfu import flops_per_token

    config = tiny_config("/tmp/unused", model_type)
    config.model.lora = dict(LORA, target_modules=targets)
    m = config.model
    seq = 32
    without = flops_per_token(config.model, seq)
    model = build_model(config.model)
    per_token = {}
    for name, p in model.named_parameters():
        if p.ndim < 2 or "embed_tokens" in name or "router" in name or "gate.weight" in name:
            continue
        kind = "adapter" if ".lora_" in name else "base"
        share = m.num_experts_per_tok / m.num_experts if ".experts." in name else 1.0
        per_token[kind] = per_token.get(kind, 0.0) + p.numel() * share
    assert per_token["adapter"] > 0
    router = m.num_hidden_layers * m.hidden_size * m.num_experts if m.num_experts else 0
    m.lora = None
    attention = flops_per_token(m, seq) - 6 * (per_token["base"] + router)  # the score FLOPs, unchanged by LoRA
    assert without == pytest.approx(4 * (per_token["base"] + router) + 6 * per_token["adapter"] + attention, rel=1e-12)


def test_the_start_up_line_says_how_many_parameters_train():
    """The start-up summary names the trainable count (the adapters: rank x (in + out) per targeted
    projection and layer, counted here from the shapes) beside the model's total."""
    from xorl.distributed.parallel_config import ParallelConfig
    from xorl.models.registry import build_model
    from xorl.observability.metrics import startup_summary

    config = tiny_config("/tmp/unused", "llama")
    config.model.lora = dict(LORA, target_modules=["q_proj", "down_proj"])
    m = config.model
    with torch.device("meta"):
        model = build_model(m)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head_dim = m.hidden_size // m.num_attention_heads
    per_layer = (m.hidden_size + m.num_attention_heads * head_dim) + (m.intermediate_size + m.hidden_size)
    assert trainable == m.num_hidden_layers * LORA["rank"] * per_layer
    total = sum(p.numel() for p in model.parameters())
    line = startup_summary(config, ParallelConfig.from_config(config, 1), total, 0, "cpu",
                           n_trainable=trainable).splitlines()[0]
    assert trainable < 1e4  # printed whole
    rank = LORA["rank"]
    assert f"{total / 1e6:.2f}M parameters ({trainable} trainable: LoRA rank {rank} on q_proj, down_proj)," in line


@pytest.mark.slow  # a Trainer, ~4 s: the full suite's
def test_startup_json_holds_the_trainable_parameters(tmp_path, monkeypatch):
    """startup.json states what the optimizer updates under LoRA (the adapters: rank x (in + out) per
    targeted projection and layer, from the shapes) beside the model's total, both counted here."""
    import json

    from tests.support.world_of_one import world_of_one
    from xorl.models.registry import build_model
    from xorl.trainer.trainer import Trainer

    config = tiny_config(str(tmp_path / "run"), "llama", max_steps=1)
    config.model.lora = dict(LORA, target_modules=["k_proj", "up_proj"])
    m = config.model
    with torch.device("meta"):
        model = build_model(m)
    head_dim = m.hidden_size // m.num_attention_heads
    per_layer = (m.hidden_size + m.num_key_value_heads * head_dim) + (m.hidden_size + m.intermediate_size)
    world_of_one(monkeypatch)
    try:
        with Trainer(config):
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    startup = json.loads((tmp_path / "run" / "startup.json").read_text())
    assert startup["trainable_parameters"] == m.num_hidden_layers * LORA["rank"] * per_layer
    assert startup["model_parameters"] == sum(p.numel() for p in model.parameters())
    assert startup["trainable_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad)

@pytest.mark.slow  # starts processes (runs xorl-train): the full suite's, not the quick tier's
def test_overwrite_output_dir_replaces_an_earlier_lora_run_and_its_adapter(tmp_path):
    """A LoRA run writes output_dir/adapter; `--train.overwrite_output_dir=true` on that folder must treat
    it as xorl's (it refused it as a foreign file before) and leave no adapter of the earlier run behind."""
    import json

    import yaml

    from tests.support.cli_runs import write_config, xorl_train

    config = write_config(tmp_path, "out", max_steps=1, save_steps=0, data_parallel_mode="none")
    first = xorl_train(config, "--model.lora={rank: 2, target_modules: [q_proj]}", cwd=tmp_path)
    assert first.code == 0, first.text
    assert json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())["r"] == 2
    again = xorl_train(config, "--model.lora={rank: 4, target_modules: [v_proj]}", "--train.overwrite_output_dir=true",
                       cwd=tmp_path)
    assert again.code == 0, again.text
    written = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert (written["r"], written["target_modules"]) == (4, ["v_proj"])
    # A full fine-tune over the LoRA run's folder: the old adapter would describe weights this run never had.
    full = xorl_train(config, "--train.overwrite_output_dir=true", cwd=tmp_path)
    assert full.code == 0, full.text
    assert not (tmp_path / "out" / "adapter").exists()
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["model"]["lora"] is None
    from xorl.cli.export import main as xorl_export  # a checkpoint without LoRA has no adapter to export

    assert xorl_export([str(tmp_path / "out"), str(tmp_path / "adapter"), "--adapter"]) == 2
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_all_linear_is_the_set_peft_resolves_on_the_transformers_model(family, tmp_path):
    """`target_modules: all-linear` (peft's shorthand; refused before) adapts what peft's own "all-linear"
    adapts on the transformers model of the folder, and the saved adapter_config lists those names."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from xorl.config import load_config
    from xorl.models.pretrained import save_pretrained
    from xorl.models.registry import build_model

    config = tiny_config(str(tmp_path / "run"), family)
    save_pretrained(build_model(config.model), str(tmp_path / "base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules="all-linear"))
    peft_targets = {name.rpartition(".")[2] for name in theirs.peft_config["default"].target_modules}
    for written in ("all-linear", "[all-linear]"):
        ours = load_config(None, [f"--model.model_path={tmp_path / 'base'}",
                                  f"--model.lora={{rank: 2, target_modules: {written}}}"])
        validate_config(ours, 1)
        assert set(ours.model.lora["target_modules"]) == peft_targets
        from xorl.checkpoint.peft_adapter import adapter_config

        assert set(adapter_config(ours.model.lora, None)["target_modules"]) == peft_targets


def test_all_linear_on_an_moe_model_and_peft_s_key_names_are_refused_with_the_fix():
    from xorl.config import load_config

    moe = load_config(None, ["--model.model_type=qwen3_moe", "--model.num_experts=4", "--model.num_experts_per_tok=2",
                             "--model.lora={rank: 2, target_modules: all-linear}"])
    with pytest.raises(ConfigError, match=r"'all-linear' is written out for dense models only; with "
                                          r"model_type='qwen3_moe' .* list the modules"):
        validate_config(moe, 1)
    message = _problems(r=4, lora_alpha=8, target_modules=["q_proj"])
    assert "peft's LoraConfig names: lora_alpha -> alpha, r -> rank" in message


def test_a_resume_compares_the_adapter_not_how_its_setting_is_written():
    """Writing a default out (dropout: 0.0, alpha = rank) or the targets in another order is the same
    adapter (it was refused as 'another architecture'); another rank, alpha or target set is not."""
    from xorl.run.resume import config_changes

    stored = Config()
    stored.model.lora = {"rank": 8, "target_modules": ["q_proj", "v_proj"]}
    stored = stored.to_dict()
    for same in ({"rank": 8, "alpha": 8, "dropout": 0.0, "target_modules": ["v_proj", "q_proj"]},
                 {"rank": 8, "alpha": 8.0, "init_lora_weights": True, "target_modules": ["q_proj", "v_proj"]}):
        config = Config()
        config.model.lora = same
        assert [c for c in config_changes(stored, config) if c[0] == "model.lora"] == []
    for other in ({"rank": 4, "target_modules": ["q_proj", "v_proj"]}, {"rank": 8, "alpha": 16, "target_modules":
                  ["q_proj", "v_proj"]}, {"rank": 8, "target_modules": ["q_proj"]}, None):
        config = Config()
        config.model.lora = other
        assert [c[0] for c in config_changes(stored, config) if c[0] == "model.lora"] == ["model.lora"]


def test_a_resume_applies_another_lora_dropout_and_refuses_another_adapter():
    """Dropout is a training knob, not what the adapter's weights mean: a resume with another dropout
    goes on with it (a note says so); another rank, alpha or target set is refused as another model."""
    from xorl.run.resume import check_resume

    stored = Config()
    stored.model.lora = {"rank": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}
    stored = stored.to_dict()
    config = Config()
    config.model.lora = {"rank": 8, "dropout": 0.0, "init_lora_weights": False, "target_modules": ["q_proj", "v_proj"]}
    problems, notes, _ = check_resume(config, stored, "ckpt", 3)
    assert problems == [] and any("model.lora" in note and "'dropout': 0.0" in note for note in notes), notes
    config.model.lora = {"rank": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}
    problems, _, _ = check_resume(config, stored, "ckpt", 3)
    assert len(problems) == 1 and "cannot resume ckpt with model.lora" in problems[0] and "architecture" in problems[0]


def test_the_adapter_names_its_base_folder_by_an_absolute_path(tmp_path, monkeypatch):
    """peft's AutoPeftModelForCausalLM loads the base from base_model_name_or_path; a model_path given
    relative to the training's cwd (it was written as given) would be looked up on the hub elsewhere."""
    from xorl.checkpoint.peft_adapter import adapter_config

    (tmp_path / "models" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    lora = {"rank": 2, "target_modules": ["q_proj"]}
    assert adapter_config(lora, "models/base")["base_model_name_or_path"] == str(tmp_path / "models" / "base")
    assert adapter_config(lora, "org/hub-name")["base_model_name_or_path"] == "org/hub-name"  # not a folder here
    assert adapter_config(lora, None)["base_model_name_or_path"] is None
