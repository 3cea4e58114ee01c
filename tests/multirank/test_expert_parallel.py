"""Expert parallelism on gloo ranks equals the single-process MoE in output and every gradient,
with balanced and fully skewed routing (ranks that receive no tokens), and composed with FSDP2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.moe_reference import tiny_qwen3_moe_config
from xorl.nn.moe import MoE

HIDDEN, INTER, TOKENS_PER_RANK = 16, 8, 12


def _rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _build(num_experts, top_k, forced_experts, ep_group=None, seed=0, shared=0) -> MoE:
    """The same random MoE on every rank; ``forced_experts`` (if any) get a selection bias so large
    that every token picks them (skewed routing)."""
    torch.manual_seed(seed)
    full = MoE(
        HIDDEN,
        num_experts,
        top_k,
        INTER,
        expert_bias=forced_experts is not None,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
        shared_expert_intermediate_size=shared,
    )
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(std=0.3)
        if forced_experts is not None:
            full.gate.e_score_correction_bias[list(forced_experts)] = 10.0
    if ep_group is None:
        return full
    sharded = MoE(
        HIDDEN,
        num_experts,
        top_k,
        INTER,
        expert_bias=forced_experts is not None,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
        ep_group=ep_group,
        shared_expert_intermediate_size=shared,
    )
    sharded.load_state_dict(full.state_dict())  # full [E, ...] expert tensors: sliced on load
    return sharded


def _inputs(world_size, seed=1, uneven=False):
    """All ranks' tokens, their output gradient, and this rank's slice. Uneven: rank r holds
    r * TOKENS_PER_RANK // 2 + r tokens, so rank 0 has none (it still joins every collective)."""
    counts = [r * TOKENS_PER_RANK // 2 + r if uneven else TOKENS_PER_RANK for r in range(world_size)]
    starts = [sum(counts[:r]) for r in range(world_size)]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), HIDDEN, generator=gen)
    grad = torch.randn(sum(counts), HIDDEN, generator=gen)
    rank = dist.get_rank()
    return x, grad, slice(starts[rank], starts[rank] + counts[rank])


def _expert_grads(moe: MoE) -> dict[str, torch.Tensor]:
    return {n: getattr(moe.experts, n).grad for n in ("gate_up_proj", "down_proj")}


def check_ep_matches_single_process(cases) -> list[dict]:
    """On every rank, for each (num_experts, top_k, forced_experts): EP over the whole world vs the
    single-process MoE on all ranks' tokens (computed locally). Returns relative errors."""
    world = dist.get_world_size()
    reports = []
    for num_experts, top_k, forced, uneven in cases:
        x, grad, mine = _inputs(world, uneven=uneven)

        ref = _build(num_experts, top_k, forced)
        x_ref = x.clone().requires_grad_()
        out_ref = ref(x_ref)[0]
        (out_ref * grad).sum().backward()

        ep = _build(num_experts, top_k, forced, ep_group=dist.group.WORLD)
        x_ep = x[mine].clone().requires_grad_()
        out = ep(x_ep)[0]
        (out * grad[mine]).sum().backward()

        # Router weight: replicated; each rank holds the gradient of its own tokens -> sum them.
        gate_grad = ep.gate.weight.grad.clone()
        dist.all_reduce(gate_grad)
        report = {
            "case": (num_experts, top_k, forced, uneven),
            "out": _rel_err(out, out_ref[mine]),
            "x_grad": _rel_err(x_ep.grad, x_ref.grad[mine]),
            "gate_grad": _rel_err(gate_grad, ref.gate.weight.grad),
        }
        for name, local in _expert_grads(ep).items():
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local.contiguous())
            full = torch.cat(gathered)
            ref_grad = _expert_grads(ref)[name]
            report[name] = _rel_err(full, ref_grad)
            # Experts that no token chose must have exact zero gradients on their owner.
            first, last = ep.local_expert_range
            unused = ref_grad[first:last].flatten(1).abs().sum(1) == 0
            report[f"{name}_unused_exact_zero"] = bool((local[unused] == 0).all())
            report[f"{name}_num_unused"] = int(unused.sum())
        reports.append(report)
    return reports


def check_not_divisible_error() -> str:
    try:
        MoE(HIDDEN, dist.get_world_size() + 1, 1, INTER, ep_group=dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return "no error"


def check_ep_times_fsdp(num_experts, top_k, as_dtensor) -> dict:
    """EP=2 x FSDP=2 on 4 ranks: mesh ("ep_fsdp", "ep"), experts sharded by fully_shard over ep_fsdp;
    as_dtensor: the experts are first DTensors over "ep" (2-D sharding, global [E, ...] shapes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep_fsdp", "ep"))
    x, grad, mine = _inputs(world, seed=5)

    ref = _build(num_experts, top_k, None, seed=3)
    x_ref = x.clone().requires_grad_()
    (ref(x_ref)[0] * grad).sum().backward()

    if as_dtensor:  # the plan's way: all experts built, this rank's kept as DTensors over "ep"
        ep = _build(num_experts, top_k, None, seed=3)
        ep.distribute_experts(mesh["ep"])
    else:  # the module's own way: only the local experts, plain tensors
        ep = _build(num_experts, top_k, None, ep_group=mesh.get_group("ep"), seed=3)
    holder = torch.nn.ModuleDict({"moe": ep})
    # FSDP over ep_fsdp with summed gradients, as parallel/data_parallel.apply_fsdp does for experts.
    fully_shard(ep.experts, mesh=mesh["ep_fsdp"])
    ep.experts.set_gradient_divide_factor(1.0)
    ep.experts.set_force_sum_reduction_for_comms(True)
    assert isinstance(ep.experts, FSDPModule)
    x_ep = x[mine].clone().requires_grad_()
    out = ep(x_ep)[0]
    (out * grad[mine]).sum().backward()

    report = {"out": _rel_err(out, ref(x[mine])[0].detach()), "x_grad": _rel_err(x_ep.grad, x_ref.grad[mine])}
    ep_group = mesh.get_group("ep")
    for name in ("gate_up_proj", "down_proj"):
        # Summed over every rank's tokens (the loss is a sum), like the single-process reference.
        full = getattr(ep.experts, name).grad.full_tensor()
        if not as_dtensor:  # full_tensor() gathered ep_fsdp only: this EP rank's experts
            gathered = [torch.empty_like(full) for _ in range(mesh["ep"].size())]
            dist.all_gather(gathered, full.contiguous(), group=ep_group)
            full = torch.cat(gathered)
        report[name] = _rel_err(full, _expert_grads(ref)[name])
    if as_dtensor:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(holder, options=StateDictOptions(full_state_dict=True))
        for name in ("gate_up_proj", "down_proj"):
            report[f"state_dict {name}"] = _rel_err(sd[f"moe.experts.{name}"], getattr(ref.experts, name))
    gate_grad = ep.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)
    report["gate_grad"] = _rel_err(gate_grad, ref.gate.weight.grad)
    return report


def check_plan_on_qwen3_moe_model(num_experts, use_mesh) -> dict:
    """apply_expert_parallel on the xorl Qwen3-MoE model: logits and every gradient equal the
    unmodified model's on all ranks' tokens."""

    from xorl.models import build_model
    from xorl.parallel.expert_parallel import apply_expert_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    config = tiny_qwen3_moe_config(vocab_size=97, num_experts=num_experts, router_aux_loss_coef=0.01,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(0)
    ref = build_model(config)
    torch.manual_seed(0)
    model = build_model(config)
    from torch.distributed.device_mesh import init_device_mesh

    if use_mesh:  # the 1-D "ep" mesh
        ep = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    else:  # the 2-D EP mesh the trainer passes (ParallelState.ep_mesh), with an ep_fsdp dim of 1
        ep = init_device_mesh("cpu", (1, world), mesh_dim_names=("ep_fsdp", "ep"))
    replaced = apply_expert_parallel(model, ep).blocks
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (world, 6), generator=gen)
    grad = torch.randn(world, 6, 97, generator=gen)

    logits_ref = ref(ids).logits
    (logits_ref * grad).sum().backward()
    logits = model(ids[rank : rank + 1]).logits
    (logits * grad[rank : rank + 1]).sum().backward()

    report = {"replaced": replaced, "logits": _rel_err(logits, logits_ref[rank : rank + 1])}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if ".experts." in name:
            g = g.full_tensor()
        else:
            dist.all_reduce(g)  # replicated parameter: sum of the per-rank token gradients
        report[name] = _rel_err(g, ref_params[name].grad)
    return report


CASES = [
    (8, 2, None, False),  # balanced-ish random routing
    (8, 1, (0,), False),  # every token to expert 0: all other ranks receive nothing
    (8, 2, (0, 1), False),  # both choices on rank 0's experts
    (8, 2, None, True),  # uneven tokens per rank, rank 0 has none
]


def _assert_reports(reports_per_rank, tol=1e-5):
    for rank, reports in enumerate(reports_per_rank):
        for rep in reports:
            for key, value in rep.items():
                if key in ("out", "x_grad", "gate_grad", "gate_up_proj", "down_proj"):
                    assert value < tol, (rank, rep)
                if key.endswith("exact_zero"):
                    assert value, (rank, rep)


def check_ep1_groups() -> float:
    """EP = 1 inside a multi-rank world: a one-rank EP group per rank, own tokens only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    x, grad, mine = _inputs(world)
    ref = _build(8, 2, None)
    ep = _build(8, 2, None, ep_group=groups[rank])
    assert ep.ep_size == 1 and ep.num_local_experts == 8
    out_ref, out = ref(x[mine])[0], ep(x[mine])[0]
    (out_ref * grad[mine]).sum().backward()
    (out * grad[mine]).sum().backward()
    errs = [_rel_err(out, out_ref)] + [
        _rel_err(a, b) for a, b in zip(_expert_grads(ep).values(), _expert_grads(ref).values())
    ]
    return max(errs)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_matches_single_process(gloo_world, world_size):
    world = gloo_world(world_size)
    cases = CASES + ([(4, 2, None, False)] if world_size == 4 else [])  # 1 expert per rank
    reports = world.run(check_ep_matches_single_process, cases, timeout_s=120)
    _assert_reports(reports)
    # The skewed cases really left experts (and whole ranks) without tokens.
    assert any(rep["gate_up_proj_num_unused"] == 8 // world_size for rep in reports[-1][1:3])
    errors = world.run(check_not_divisible_error)
    if world_size == 2:
        assert max(world.run(check_ep1_groups)) < 1e-6
    assert all("not divisible" in e for e in errors), errors


@pytest.mark.parametrize("world_size,use_mesh", [(2, False), (4, True)])
def test_plan_swaps_model_blocks_and_keeps_parity(gloo_world, world_size, use_mesh):
    reports = gloo_world(world_size).run(check_plan_on_qwen3_moe_model, 4, use_mesh, timeout_s=120)
    for rank, rep in enumerate(reports):
        assert rep.pop("replaced") == ["model.layers.0.mlp", "model.layers.1.mlp"]
        for key, value in rep.items():
            assert value < 1e-5, (rank, key, rep)


def test_ep2_times_fsdp2(gloo_world):
    world = gloo_world(4)
    reports = world.run(check_ep_times_fsdp, 8, 2, False, timeout_s=120)
    reports += world.run(check_ep_times_fsdp, 8, 2, True, timeout_s=120)
    for rank, rep in enumerate(reports):
        for key, value in rep.items():
            assert value < 1e-5, (rank, key, rep)


def check_dispatch_sends_each_token_once_per_rank(num_experts, top_k) -> dict:
    """The rows the dispatch all_to_all sends (hidden rows: H wide) against the distinct (token,
    destination rank) pairs of the router's choices, counted here from its expert ids."""
    import xorl.nn.ep_dispatch as ep_module

    world = dist.get_world_size()
    x, grad, mine = _inputs(world, seed=7)
    ep = _build(num_experts, top_k, None, ep_group=dist.group.WORLD)
    sent = []
    real = ep_module.all_to_all_rows

    def spy(rows, output_splits, input_splits, group):
        sent.append((tuple(rows.shape), list(input_splits)))
        return real(rows, output_splits, input_splits, group)

    ep_module.all_to_all_rows = spy
    try:
        x_ep = x[mine].clone().requires_grad_()
        (ep(x_ep)[0] * grad[mine]).sum().backward()
        ids = ep.gate(x[mine]).expert_ids  # the same routing (no bias update without training steps)
    finally:
        ep_module.all_to_all_rows = real
    local = num_experts // world
    pairs = {(t, int(e) // local) for t, row in enumerate(ids.tolist()) for e in row}
    hidden = [(shape, splits) for shape, splits in sent if shape[1:] == (HIDDEN,)]
    return {"dispatch_rows": hidden[0][0][0], "pairs": len(pairs), "top_k_rows": ids.numel(),
            "per_rank": hidden[0][1],
            "pairs_per_rank": [sum(1 for _, r in pairs if r == d) for d in range(world)]}


def test_dispatch_sends_each_token_once_per_destination_rank(gloo_world):
    """8 experts, top-4, EP 2: a token picking 3 experts of one rank sends it one row, not 3 (the
    deduplicated minimum of DeepEP); the K rows are rebuilt on arrival."""
    for rank, r in enumerate(gloo_world(2).run(check_dispatch_sends_each_token_once_per_rank, 8, 4)):
        assert r["dispatch_rows"] == r["pairs"] < r["top_k_rows"], (rank, r)
        assert r["per_rank"] == r["pairs_per_rank"], (rank, r)


def check_shared_expert_under_ep() -> dict:
    """EP over the world with a Qwen2-MoE shared expert (computed while the dispatch is in flight)
    against one process on every rank's tokens: output, input and shared-expert gradients."""
    x, grad, mine = _inputs(dist.get_world_size(), seed=9)
    ref = _build(8, 2, None, shared=24)
    x_ref = x.clone().requires_grad_()
    (ref(x_ref)[0] * grad).sum().backward()
    ep = _build(8, 2, None, ep_group=dist.group.WORLD, shared=24)
    x_ep = x[mine].clone().requires_grad_()
    out = ep(x_ep)[0]
    (out * grad[mine]).sum().backward()
    report = {"out": _rel_err(out, ref(x)[0][mine]), "x_grad": _rel_err(x_ep.grad, x_ref.grad[mine])}
    for name, p in ep.named_parameters():
        if name.startswith("shared_expert"):  # replicated: each rank holds its own tokens' share
            total = p.grad.clone()
            dist.all_reduce(total)
            report[name] = _rel_err(total, dict(ref.named_parameters())[name].grad)
    return report


def test_shared_expert_under_expert_parallel(gloo_world):
    for rank, report in enumerate(gloo_world(2).run(check_shared_expert_under_ep)):
        assert len(report) == 2 + 4, report  # out, x_grad, gate/up/down + shared_expert_gate
        for what, err in report.items():
            assert err < 1e-5, (rank, what, err)
