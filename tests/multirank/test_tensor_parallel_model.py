"""apply_tensor_parallel on the real xorl models against one process, on 4 gloo ranks.

* parity: logits, loss and the gradient of every parameter (DTensor full_tensor()) of a 2-layer
  Llama equal the float64 single-process model, at TP=2 and TP=4, SP and overlap on / off,
  batch 2 and packed documents (cu_seqlens), tied embeddings; the total grad norm equals the
  single-process one; replicated parameters hold identical gradients on every TP rank.
* 2-D: FSDP2 on dp=2 x TP=2 over three AdamW steps with gradient clipping equals one process
  (losses, clip norms, parameters); a DCP checkpoint of it reloads into a plain single-process
  model with identical outputs.
* Qwen3-MoE: attention TP (q/k norms summed over TP), MoE block replicated (gathered under SP).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from xorl.nn.tp_replicated import sum_tp_partial_grads

TOL = 1e-5


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)  # destroyed by the harness after the check


def tp_mesh(tp_size: int):
    world = dist.get_world_size()
    if tp_size == world:
        return _mesh((tp_size,), ("tp",))
    return _mesh((world // tp_size, tp_size), ("dp", "tp"))["tp"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if isinstance(out, DTensor):
        out = out.full_tensor()
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def llama_config(tie: bool = False, heads: int = 4, kv_heads: int = 4, vocab: int = 48):
    return types.SimpleNamespace(
        model_type="llama", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=4, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=tie, attn_implementation="torch", max_position_embeddings=64,
    )


def moe_config():
    return types.SimpleNamespace(
        model_type="qwen3_moe", vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation="torch", max_position_embeddings=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, decoder_sparse_step=2,
        router_aux_loss_coef=0.01, norm_topk_prob=True,
    )


def build(config, seed: int):
    """The model with every parameter random (norm weights too, so a dropped weight shows)."""
    from xorl.models.registry import build_model

    torch.manual_seed(seed)
    model = build_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.float()


def batch(case: str, seed: int, vocab: int = 48):
    g = torch.Generator().manual_seed(seed)
    if case == "packed":
        ids = torch.randint(0, vocab, (1, 8), generator=g)
        return {"input_ids": ids, "labels": torch.randint(0, vocab, (1, 8), generator=g),
                "cu_seqlens": torch.tensor([0, 3, 8])}
    return {"input_ids": torch.randint(0, vocab, (2, 8), generator=g),
            "labels": torch.randint(0, vocab, (2, 8), generator=g)}


def _replicated_grad_spread(model, group) -> float:
    """Largest difference of a replicated parameter's gradient between TP ranks (must be 0)."""
    worst = 0.0
    for p in model.parameters():
        if isinstance(p, DTensor) and p.placements[-1].is_replicate() and p.grad is not None:
            local = p.grad.to_local().detach().clone()
            lo, hi = local.clone(), local.clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            worst = max(worst, (hi - lo).abs().max().item())
    return worst


def check_model_parity(tp_size: int, config_name: str, cases: list[tuple]) -> dict:
    from xorl.parallel.tensor_parallel import apply_tensor_parallel

    mesh = tp_mesh(tp_size)
    results = {}
    for sp, overlap, data_case, tie in cases:
        # "llama-odd-vocab": 50 rows do not divide by TP 4, so embedding and lm_head stay replicated.
        vocab = 50 if config_name == "llama-odd-vocab" else 48
        config = moe_config() if config_name == "moe" else llama_config(tie=tie, vocab=vocab)
        if config_name == "llama-merged":  # one qkv_proj (2 query heads per KV group), one gate_up_proj
            config = types.SimpleNamespace(**{**vars(llama_config(tie=tie, kv_heads=2)), "merge_qkv": True,
                                              "merge_gate_up": True})
        base = build(config, seed=1)
        ref = copy.deepcopy(base).double()
        model = copy.deepcopy(base)
        tp_plan = apply_tensor_parallel(model, mesh, sequence_parallel=sp, overlap=overlap, overlap_min_numel=0)
        data = batch(data_case, seed=2, vocab=vocab)
        extra = {k: v for k, v in data.items() if k == "cu_seqlens"}
        out_ref = ref(data["input_ids"], labels=data["labels"], **extra)
        loss_ref = out_ref.loss + (out_ref.router_loss if out_ref.router_loss is not None else 0)
        loss_ref.backward()
        if config_name == "moe":  # MoE blocks run on TP token shards: balance over the TP group (parallelize does)
            from xorl.parallel.expert_parallel import set_router_balance_group

            set_router_balance_group(model, mesh.get_group())
        out = model(data["input_ids"], labels=data["labels"], **extra)
        loss = out.loss + (out.router_loss if out.router_loss is not None else 0)
        loss.backward()
        if config_name == "moe":  # each TP rank's experts saw its own tokens: FSDP over TP sums these
            for name, p in model.named_parameters():
                if ".experts." in name:
                    dist.all_reduce(p.grad, group=mesh.get_group())
        if out.router_loss is not None:  # each TP rank holds its tokens' share of the router loss
            router_total = out.router_loss.detach().clone()
            dist.all_reduce(router_total, group=mesh.get_group())
            loss = out.loss.detach() + router_total
        # The partial gradients of replicated parameters (SP norms, q/k norms): one all-reduce.
        partial_sums = sum_tp_partial_grads([tp_plan.partial_grads])
        with torch.no_grad():  # with labels the loss is fused (no logits); a call without them gives logits
            logits, logits_ref = model(data["input_ids"], **extra).logits, ref(data["input_ids"], **extra).logits
        errs = {"logits": rel_err(logits, logits_ref), "loss": rel_err(loss, loss_ref)}
        ref_params = dict(ref.named_parameters())
        names = [n for n, _ in model.named_parameters()]
        assert sorted(names) == sorted(ref_params), "TP must keep the parameter names"
        for name, p in model.named_parameters():
            errs[f"grad {name}"] = rel_err(p.grad, ref_params[name].grad)
        if config_name == "moe":  # MoE blocks stay plain tensors (for EP / FSDP): xorl's cross-mesh norm
            from xorl.trainer.grad_clip import total_grad_norm as norm_of
        else:  # every parameter is a DTensor on the TP mesh: torch's clip sees the whole norm
            def norm_of(params):
                return torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf"))
        norm = norm_of(model.parameters())
        norm_ref = torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None]).norm()
        errs["grad_norm"] = rel_err(norm, norm_ref)
        results[(sp, overlap, data_case, tie)] = {
            "errs": errs,
            "partial_sums": partial_sums,
            "expected_partial_sums": int(sp or config_name == "moe"),
            "spread": _replicated_grad_spread(model, mesh.get_group()),
            "dtensor_params": all(isinstance(p, DTensor) for n, p in model.named_parameters()
                                  if ".mlp." not in n or config_name != "moe"),
        }
    return results


LLAMA_CASES = {
    4: [(True, True, "batch", False), (True, False, "packed", False), (False, True, "batch", True)],
    2: [(True, True, "packed", True), (False, False, "batch", False)],
}


@pytest.mark.parametrize("tp_size", [2, 4])
def test_llama_matches_single_process(gloo_world, tp_size):
    world = gloo_world(4)
    for rank, results in enumerate(world.run(check_model_parity, tp_size, "llama", LLAMA_CASES[tp_size])):
        for case, r in results.items():
            for what, err in r["errs"].items():
                assert err <= TOL, f"rank {rank} tp={tp_size} (sp, overlap, data, tie)={case}: {what} {err:.2e}"
            assert r["spread"] == 0.0, f"replicated grads differ across TP ranks: {case} {r['spread']}"
            assert r["partial_sums"] == r["expected_partial_sums"], (case, r["partial_sums"])
            assert r["dtensor_params"]


def test_vocabulary_tp_does_not_divide_stays_replicated(gloo_world):
    """vocab 50 at TP 4: embedding and lm_head replicated (the SP region split after the embedding and
    gathered before the lm_head), still equal to one process."""
    cases = [(True, True, "packed", True), (False, False, "batch", False)]
    for rank, results in enumerate(gloo_world(4).run(check_model_parity, 4, "llama-odd-vocab", cases)):
        for case, r in results.items():
            for what, err in r["errs"].items():
                assert err <= TOL, f"rank {rank} odd vocab {case}: {what} {err:.2e}"
            assert r["spread"] == 0.0, case


def test_qwen3_moe_attention_tp_matches_single_process(gloo_world):
    world = gloo_world(4)
    cases = [(True, True, "batch", False), (False, True, "packed", False)]
    for rank, results in enumerate(world.run(check_model_parity, 4, "moe", cases)):
        for case, r in results.items():
            for what, err in r["errs"].items():
                assert err <= TOL, f"rank {rank} moe (sp, overlap, data, tie)={case}: {what} {err:.2e}"
            assert r["spread"] == 0.0, case
            assert r["partial_sums"] == 1, case  # q/k norms always; SP norms too: still one all-reduce


def check_fsdp_tp_training(checkpoint_dir: str, steps: int = 3) -> dict:
    """dp=2 x tp=2: FSDP2 on dp over the TP model; AdamW + clipping; then DCP save -> plain load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from xorl.parallel.tensor_parallel import apply_tensor_parallel

    mesh = _mesh((2, 2), ("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    config = llama_config()
    base = build(config, seed=3)
    ref = copy.deepcopy(base)
    model = copy.deepcopy(base)
    tp_plan = apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True, overlap=True, overlap_min_numel=0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for step in range(steps):
        data = batch("batch", seed=10 + step)  # the global batch: dp rank d takes row d
        mine = {k: v[dp_rank:dp_rank + 1] for k, v in data.items()}
        loss = model(mine["input_ids"], labels=mine["labels"]).loss
        loss.backward()  # FSDP averages the gradients over dp
        assert sum_tp_partial_grads([tp_plan.partial_grads]) == 1  # the SP norms' partial gradients, in one all-reduce
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        opt.zero_grad()
        ref_losses = [ref(data["input_ids"][d:d + 1], labels=data["labels"][d:d + 1]).loss for d in range(2)]
        loss_ref = sum(ref_losses) / 2
        loss_ref.backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
        opt_ref.step()
        opt_ref.zero_grad()
        losses.append(rel_err(loss, ref_losses[dp_rank]))
        norms.append(rel_err(norm, norm_ref))
    ref_params = dict(ref.named_parameters())
    param_errs = {n: rel_err(p, ref_params[n]) for n, p in model.named_parameters()}

    dcp.save(model.state_dict(), checkpoint_id=checkpoint_dir)
    dist.barrier()
    plain = build(config, seed=99)  # different values until loaded
    before = rel_err(plain.lm_head.weight, ref.lm_head.weight)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)
    plain.load_state_dict(state)
    probe = batch("packed", seed=50)
    with torch.no_grad():
        out_plain = plain(probe["input_ids"], cu_seqlens=probe["cu_seqlens"]).logits
        out_ref = ref(probe["input_ids"], cu_seqlens=probe["cu_seqlens"]).logits
    return {"losses": losses, "norms": norms, "params": param_errs, "dcp_logits": rel_err(out_plain, out_ref),
            "dcp_before": before, "clipped": float(norm_ref) > 0.5}


def test_fsdp2_x_tp_adamw_clip_and_dcp_match_single_process(gloo_world, tmp_path):
    world = gloo_world(4)
    for rank, r in enumerate(world.run(check_fsdp_tp_training, str(tmp_path / "ckpt"))):
        assert r["clipped"], "the check must actually clip"
        for step, (l_err, n_err) in enumerate(zip(r["losses"], r["norms"])):
            assert l_err <= TOL, f"rank {rank} step {step}: loss rel err {l_err:.2e}"
            assert n_err <= TOL, f"rank {rank} step {step}: clip total norm rel err {n_err:.2e}"
        for name, err in r["params"].items():
            assert err <= 2e-5, f"rank {rank}: parameter {name} after AdamW steps rel err {err:.2e}"
        assert r["dcp_before"] > 0.1  # the fresh model really differed before loading
        assert r["dcp_logits"] <= TOL, f"rank {rank}: DCP reload logits rel err {r['dcp_logits']:.2e}"


def check_plan_errors() -> dict:
    from xorl.parallel.tensor_parallel import apply_tensor_parallel

    mesh = tp_mesh(4)
    messages = {}
    cases = {
        "heads": lambda: apply_tensor_parallel(build(llama_config(heads=4, kv_heads=2), 0), mesh),
        "not_causal_lm": lambda: apply_tensor_parallel(torch.nn.Linear(4, 4), mesh),
    }
    for name, make in cases.items():
        try:
            make()
            messages[name] = None
        except (ValueError, TypeError) as e:
            messages[name] = str(e)
    model = build(llama_config(), 0)
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    try:
        model(torch.randint(0, 48, (1, 6)))  # 6 tokens, TP=4
        messages["seq"] = None
    except ValueError as e:
        messages["seq"] = str(e)
    return messages


def test_plan_errors_are_clear(gloo_world):
    world = gloo_world(4)
    m = world.run(check_plan_errors)[0]
    assert m["heads"] and "divisible by tensor_parallel_size=4" in m["heads"]
    assert m["not_causal_lm"] and "HF-style causal LM" in m["not_causal_lm"]
    assert m["seq"] and "pad" in m["seq"]


def check_meta_build_then_init() -> dict:
    """Build on meta, apply TP, to_empty, init_weights: a usable init, identical on every rank."""
    from xorl.models.registry import build_model
    from xorl.parallel.tensor_parallel import apply_tensor_parallel

    with torch.device("meta"):
        model = build_model(llama_config(tie=True))
    apply_tensor_parallel(model, tp_mesh(2), sequence_parallel=True, overlap_min_numel=0)
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    model.init_weights()
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, full)
    spread = max((g[n] - full[n]).abs().max().item() for g in gathered for n in full)
    return {"spread": spread, "std": {n: t.std().item() for n, t in full.items()},
            "tied": model.lm_head.weight is model.model.embed_tokens.weight}


def test_meta_build_tp_then_init_weights(gloo_world):
    world = gloo_world(4)
    r = world.run(check_meta_build_then_init)[0]
    assert r["spread"] == 0.0 and r["tied"]
    for name, std in r["std"].items():
        if "norm" in name:
            assert std == 0.0, name  # ones
        else:
            assert 0.015 < std < 0.025, (name, std)  # normal(0, initializer_range=0.02)


def lm_head_flops(tp_size: int, sequence_parallel: bool) -> tuple[int, int]:
    """(FLOPs of the TP lm_head on this rank, FLOPs of the single-process lm_head) for one batch."""
    from torch.utils.flop_counter import FlopCounterMode

    from xorl.parallel.tensor_parallel import apply_tensor_parallel

    base = build(llama_config(), seed=5)
    model = copy.deepcopy(base)
    apply_tensor_parallel(model, tp_mesh(tp_size), sequence_parallel=sequence_parallel)
    hidden = torch.randn(2, 8, 16)
    local = hidden.chunk(tp_size, dim=1)[dist.get_rank(tp_mesh(tp_size).get_group())] if sequence_parallel else hidden
    with FlopCounterMode(display=False) as tp_flops:
        model.lm_head(local)
    with FlopCounterMode(display=False) as ref_flops:
        base.lm_head(hidden)
    return tp_flops.get_total_flops(), ref_flops.get_total_flops()


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_lm_head_flops_per_rank_are_one_tp_th(gloo_world, sequence_parallel):
    for mine, total in gloo_world(4).run(lm_head_flops, 4, sequence_parallel):
        assert total > 0 and mine * 4 == total, (mine, total)


def test_merged_qkv_matches_single_process(gloo_world):
    """merge_qkv and merge_gate_up under TP 2: the one qkv_proj split by KV-head groups, the one
    gate_up_proj by intermediate units (SP and overlap on and off)."""
    cases = [(True, True, "packed", False), (False, False, "batch", True)]
    for rank, results in enumerate(gloo_world(2).run(check_model_parity, 2, "llama-merged", cases)):
        for case, r in results.items():
            for what, err in r["errs"].items():
                assert err <= TOL, f"rank {rank} merged qkv {case}: {what} {err:.2e}"
            assert r["spread"] == 0.0, case
            assert r["dtensor_params"]


def count_qkv_gemms() -> dict:
    """GEMMs (aten mm / addmm) of the q/k/v and the gate/up projections of one layer, SP with the
    overlapped ring all-gather: merged, one per TP chunk each; separate (one shared gather), three
    and two per chunk."""
    from xorl.parallel.tensor_parallel import apply_tensor_parallel

    class CountGemms(torch.profiler.profile):
        """The profiler's aten::mm / addmm calls: unlike a TorchDispatchMode it also sees the GEMMs
        inside the TP linears' custom ops (xorl/nn/tp_linear_ops.py)."""

        def __init__(self):
            super().__init__(activities=[torch.profiler.ProfilerActivity.CPU])

        @property
        def n(self) -> int:
            return sum(e.name in ("aten::mm", "aten::addmm") for e in self.events())

    mesh = tp_mesh(dist.get_world_size())
    counts = {}
    for merged in (True, False):
        config = types.SimpleNamespace(**{**vars(llama_config(kv_heads=2)), "merge_qkv": merged,
                                          "merge_gate_up": merged})
        model = build(config, seed=3)
        apply_tensor_parallel(model, mesh, sequence_parallel=True, overlap=True, overlap_min_numel=0)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        x = torch.randn(1, 4, 16)  # this rank's sequence shard
        with CountGemms() as qkv:
            attn.qkv_proj(x) if merged else attn.q_proj(x)
        with CountGemms() as gate_up:
            mlp.gate_up_proj(x) if merged else mlp.gate_proj(x)
        counts[merged] = (qkv.n, gate_up.n)
    return counts


def test_merged_qkv_runs_one_gemm_per_chunk(gloo_world):
    for counts in gloo_world(2).run(count_qkv_gemms):
        assert counts == {True: (2, 2), False: (6, 4)}, counts  # TP 2: two ring chunks
