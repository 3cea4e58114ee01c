"""Expert parallelism x FSDP2 and tensor parallelism of stock transformers models on xorl's kernels, set
up by transformers itself from ``xorl.hf.distributed_config`` (``from_pretrained(distributed_config=...)``:
xorl's deduplicated EP dispatch registered in its EPImplementationInterface, xorl's TP linears in its
ParallelInterface, transformers' FSDP2 plan).

Against one process running the stock eager model (eager attention and experts) on the union of the
ranks' batches: 3 SGD steps, each step's loss and every parameter's final value within 1e-5 (fp32),
and its total update within 5e-5 (UPDATE_TOL: why):

- EP 2 x expert-FSDP 2 on 4 gloo ranks (dense parameters FSDP over 4) for Qwen3-MoE and Mixtral,
  each rank its own batch, the loss normalised by the step's global token count times the
  data-parallel size (HF Trainer's scaling), xorl's dispatch counted as the one that ran;
- TP 2 through a tp_plan naming xorl's styles for a Llama-3.1-style model and Qwen3 (whose per-head
  q/k norms keep transformers' ``replicated_with_grad_allreduce`` beside xorl's linears), xorl's column
  ops counted, the q/k/v and MLP weights held as DTensor shards.

xorl's EP implementation refuses experts it does not run (another ``experts_implementation``) and a
TP group over the EP ranks, by name; xorl's TP styles, named by a hand-written tp_plan, refuse a module
that is not a linear and a width that does not split (a DTensor input is refused too, untested here:
no stock style hands one on). The refusals of ``distributed_config`` (sizes checked before
anything is built): tests/unit/hf/test_distributed_config.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from tests.unit.models.test_families import FAMILIES, SMALL, hf_checkpoint, rel_err  # noqa: E402

TOL = 1e-5
# The updates themselves (the weights' change over the 3 steps) are held to 5e-5: the stock fp32 model's own
# updates differ from its float64 run's by up to 1.2e-5 (Qwen3-MoE's q/k-norm weights, whose gradient sums
# many terms of both signs), so 1e-5 on them would measure rounding, not the parallelism. (Measured: worst
# 8.8e-6 Qwen3-MoE, 6.3e-6 Mixtral, 3.9e-6 Llama TP 2, 1.7e-5 Qwen3 TP 2 (its k-norm); losses within
# 2.1e-7, weights within 9.9e-7.)
UPDATE_TOL = 5e-5
STEPS, ROWS, SEQ, LR = 3, 2, 12, 0.5


class _Counted:
    """Counts the calls of a function the xorl/hf modules call (a test spy; xorl itself is unchanged)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _step_ids(seed, dp):
    """Each step's token ids for every data-parallel rank: [steps, dp * ROWS, SEQ]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (STEPS, dp * ROWS, SEQ), generator=gen)


def _full(p):
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _parallel_run(folder, name, layout, seed, spied):
    """Load with ``distributed_config(**layout)``, train STEPS SGD steps; (losses, updates, spy calls, kinds)."""
    import xorl.hf

    world, tp = dist.get_world_size(), layout.get("tp", 1)
    dp, dp_rank = world // tp, dist.get_rank() // tp
    cls = getattr(transformers, FAMILIES[name][0])
    import importlib

    module, attr = importlib.import_module(spied[0]), spied[1]
    spy = _Counted(getattr(module, attr))
    setattr(module, attr, spy)
    try:
        layout_config = xorl.hf.distributed_config(folder, **layout)
        model = cls.from_pretrained(folder, attn_implementation="xorl", experts_implementation="xorl",
                                    dtype=torch.float32, distributed_config=layout_config)
        model.train()
        start = {n: _full(p) for n, p in model.named_parameters()}
        kinds = {n: (type(p).__name__, tuple(repr(x) for x in getattr(p, "placements", ())))
                 for n, p in model.named_parameters()}
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for ids in _step_ids(seed, dp):
            mine = ids[dp_rank * ROWS: (dp_rank + 1) * ROWS]  # TP ranks share their data-parallel rank's rows
            batch = {"input_ids": mine, "labels": mine.clone()}
            n = (batch["labels"][:, 1:] != -100).sum()
            dist.all_reduce(n)
            n = n // tp  # the step's targets over the data-parallel ranks (each TP rank counted them once)
            loss = model(**batch, num_items_in_batch=n).loss * dp
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach() / dp
            dist.all_reduce(total)
            losses.append(float(total) / tp)
        updates = {n: _full(p) - start[n] for n, p in model.named_parameters()}
    finally:
        setattr(module, attr, spy.fn)
    return losses, updates, spy.calls, kinds


def _one_process(folder, name, dp, seed):
    """The stock eager model (attention and experts) on every rank's rows at once, the same SGD."""
    cls = getattr(transformers, FAMILIES[name][0])
    model = cls.from_pretrained(folder, attn_implementation="eager", experts_implementation="eager",
                                dtype=torch.float32).train()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in _step_ids(seed, dp):
        loss = model(input_ids=ids, labels=ids.clone()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, start, {n: p.detach() - start[n] for n, p in model.named_parameters()}


def _assert_equal_runs(results, reference):
    """Losses and final weights within TOL; each parameter's total update within UPDATE_TOL."""
    ref_losses, start, ref_updates = reference
    for losses, updates, _, _ in results:
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        assert updates.keys() == ref_updates.keys()
        worst = max((rel_err(start[k] + updates[k], start[k] + u), k) for k, u in ref_updates.items())
        assert worst[0] <= TOL, worst
        worst = max((rel_err(updates[k], u), k) for k, u in ref_updates.items())
        assert worst[0] <= UPDATE_TOL, worst


@pytest.mark.parametrize("name,experts", [("qwen3_moe", {}), ("mixtral", {"num_local_experts": 4})])
def test_ep2_x_fsdp2_on_a_stock_moe_model_equals_one_process(name, experts, gloo_world, tmp_path):
    folder = str(tmp_path / name)
    hf_checkpoint(name, folder, seed=1, **experts)
    spied = ("xorl.hf.expert_parallel", "expert_parallel_moe")
    results = gloo_world(4).run(_parallel_run, folder, name, {"ep": 2}, 3, spied)
    _assert_equal_runs(results, _one_process(folder, name, 4, 3))
    for _, _, calls, kinds in results:
        assert calls == STEPS * SMALL["num_hidden_layers"]  # xorl's dispatch, every MoE layer, every step
        experts_kind = kinds["model.layers.0.mlp.experts.gate_up_proj"]
        assert experts_kind[0] == "DTensor" and len(experts_kind[1]) == 2  # EP shards, FSDP-sharded again
        assert kinds["model.layers.0.self_attn.q_proj.weight"][0] == "DTensor"  # dense FSDP2


@pytest.mark.parametrize("name", ["llama3.1-rope-llama3", "qwen3"])  # qwen3: its per-head q/k norms on
def test_tp2_through_a_tp_plan_with_xorl_styles_equals_one_process(name, gloo_world, tmp_path):  # stock styles
    folder = str(tmp_path / name)
    hf_checkpoint(name, folder, seed=1)
    spied = ("xorl.hf.tensor_parallel", "column_parallel_linear")
    results = gloo_world(2).run(_parallel_run, folder, name, {"tp": 2}, 4, spied)
    _assert_equal_runs(results, _one_process(folder, name, 1, 4))
    for _, _, calls, kinds in results:
        # q, k, v, gate, up in each layer, each step (forward only: the backward is the op's own).
        assert calls == STEPS * SMALL["num_hidden_layers"] * 5
        assert kinds["model.layers.0.self_attn.q_proj.weight"] == ("DTensor", ("Shard(dim=0)",))
        assert kinds["model.layers.0.mlp.down_proj.weight"] == ("DTensor", ("Shard(dim=1)",))


def _ep_refusals(folder):
    """xorl's EP implementation refuses experts it does not run, and a TP group sharing the EP ranks."""
    from transformers.distributed import DistributedConfig

    import xorl.hf

    messages = {}
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(
        folder, experts_implementation="grouped_mm", dtype=torch.float32,
        distributed_config=xorl.hf.distributed_config(folder, ep=2))
    try:
        model(input_ids=torch.arange(8)[None])
    except ValueError as e:
        messages["experts"] = str(e)
    try:
        transformers.Qwen3MoeForCausalLM.from_pretrained(
            folder, experts_implementation="xorl", dtype=torch.float32,
            distributed_config=DistributedConfig(tp_size=2, ep_size=2, tp_plan={}, ep_implementation="xorl"))
    except ValueError as e:
        messages["tp"] = str(e)
    return messages


def test_xorl_expert_parallelism_refuses_what_it_does_not_run(gloo_world, tmp_path):
    folder = str(tmp_path / "qwen3_moe")
    hf_checkpoint("qwen3_moe", folder, seed=1)
    for messages in gloo_world(2).run(_ep_refusals, folder):
        assert "experts_implementation is 'grouped_mm'; load it with experts_implementation=\"xorl\"" in \
            messages["experts"]
        assert "tp_size=2" in messages["tp"] and "use tp_size=1 with expert parallelism" in messages["tp"]


def _tp_refusals(folder):
    """xorl's TP styles, named by a hand-written tp_plan (no distributed_config to check it first)."""
    from transformers.distributed import DistributedConfig

    import xorl.hf

    messages = {}
    for what, plan in (("not a linear", {"model.embed_tokens": "xorl_colwise"}),
                       ("width", xorl.hf.xorl_tp_plan(folder))):
        try:
            transformers.LlamaForCausalLM.from_pretrained(
                folder, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=2, tp_plan=plan))
        except xorl.hf.XorlTPError as e:
            messages[what] = str(e)
    return messages


def test_xorl_tp_styles_refuse_what_they_cannot_split_exactly(gloo_world, tmp_path):
    folder = str(tmp_path / "llama")
    hf_checkpoint("llama3.1-rope-llama3", folder, seed=1, intermediate_size=41)
    for messages in gloo_world(2).run(_tp_refusals, folder):
        assert "shard nn.Linear layers; Embedding is not one" in messages["not a linear"]
        assert "Linear with out_features=41 does not split over 2 TP ranks; choose a tp_size dividing it" in \
            messages["width"]
