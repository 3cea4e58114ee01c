"""Selective activation checkpointing under tensor parallelism (2 gloo ranks, a small Llama).

train.activation_checkpointing: selective promises to recompute no matmul. Under TP the column
layers (gather + GEMMs, ring or plain) and row layers (GEMM + reduce-scatter / all-reduce) are one
dispatcher op each (xorl/nn/tp_linear_ops.py) whose output the SAC cache keeps, so:

* census: each block's cache holds exactly q, k, v | attention out + lse | o's reduced output |
  gate, up | down's reduced output (their bytes to the byte), with TP 2 + SP on the ring path
  (overlap, threshold 0) and the plain path, and without SP; the recompute runs no GEMM and no
  collective (the ops it replays are element-wise);
* backward: the GEMM FLOPs (FlopCounterMode, which counts the TP ops through their formulas) and
  the TP collectives (the layers' communication record plus c10d ops seen by the dispatcher) of
  selective equal those of no checkpointing, while full recompute runs every block's forward
  matmuls and collectives again;
* LoRA on every projection: the adapters' rank-wide gather / reduce-scatter / all-reduce
  (xorl/nn/tp_regions.py's ops) are kept too: the recompute again runs no GEMM or collective;
* every_other_matmul counts a TP op's GEMMs in the block's order (q, k, v | o | gate, up | down)
  and keeps an op when any of its GEMMs falls on a kept (odd) position: o alone is recomputed;
* parity: selective's loss and gradients equal no checkpointing's bit for bit, and both equal a
  float64 single-process run to fp32 rounding (relative error < 1e-5).

No MoE here: selective with an MoE model under TP > 1 is refused with fsdp2, and TP refuses ddp,
so no accepted layout has it (xorl/config/rules/parallel.py).
"""

from __future__ import annotations

import copy
import types
from unittest import mock

import torch
import torch.distributed as dist

from tests.multirank.test_tensor_parallel_model import build, rel_err
from xorl.nn.tp_replicated import sum_tp_partial_grads

H, HQ, HKV, INTER, HEADS, TOKENS, BATCH = 16, 16, 8, 48, 4, 16, 1


def llama_config(lora: dict | None = None):
    return types.SimpleNamespace(
        model_type="llama", vocab_size=48, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation="xorl", max_position_embeddings=64,
        **({"lora": lora} if lora else {}),
    )


class _Census:
    """Each checkpointed block call's selective-checkpoint decisions, made in its forward: what it
    kept (the outputs of every op the policy saved, read from the block's SAC storage in the order
    the ops ran) and the ops its recompute runs again (the ones the policy did not save). Works on
    torch 2.11 (storage: op -> saved outputs) and 2.13 (op -> call index -> output or recompute)."""

    def __init__(self):
        self.blocks: list[dict] = []

    def wrap(self, create):
        from torch.utils.checkpoint import CheckpointPolicy

        def contexts(policy_fn, *args, **kwargs):
            block = {"decisions": [], "kept": [], "recomputed": []}

            def recording(ctx, op, *a, **kw):
                decision = policy_fn(ctx, op, *a, **kw)
                if not ctx.is_recompute:
                    block["decisions"].append((op, decision in (CheckpointPolicy.MUST_SAVE,
                                                                CheckpointPolicy.PREFER_SAVE)))
                return decision

            forward, recompute = create(recording, *args, **kwargs)
            block["storage"] = forward.storage
            self.blocks.append(block)
            return forward, recompute

        return contexts

    def read(self) -> None:
        """Fill each block's kept / recomputed lists (call after the forward, before backward)."""
        from torch.utils._pytree import tree_leaves

        recompute = getattr(torch.utils.checkpoint, "_RECOMPUTE", None)  # 2.13's "not saved" entry
        for block in self.blocks:
            saved = {}
            for op, entries in block.pop("storage").items():
                entries = [e for _, e in sorted(entries.items())] if isinstance(entries, dict) else entries
                saved[op] = [e for e in entries if e is not recompute]
            for op, saves in block.pop("decisions"):
                if not saves:
                    block["recomputed"].append(str(op))
                    continue
                wrapped = tree_leaves(saved[op].pop(0), is_leaf=lambda x: hasattr(x, "val"))
                leaves = [getattr(x, "val", x) for x in wrapped]
                block["kept"].append((str(op), [(tuple(t.shape), t.element_size()) for t in leaves
                                                if isinstance(t, torch.Tensor)]))


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The collectives (c10d ops, the TP regions' ops) and GEMMs the dispatcher sees; inside a custom
    op it sees nothing: the TP linears' own communication is counted by their record (overlap_report)."""

    def __init__(self):
        super().__init__()
        self.collectives = self.gemms = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.collectives += func.namespace in ("c10d", "_c10d_functional") or str(func).startswith(
            ("xorl.tp_all_gather", "xorl.tp_reduce_scatter", "xorl.tp_all_reduce"))
        self.gemms += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        return func(*args, **(kwargs or {}))


def _tp_comm(model) -> int:
    """Plain collectives + ring exchanges the TP layers ran since the last call (resets the record)."""
    from xorl.nn.tp_comm import overlap_report

    return sum(r["collectives"] + r["ring_steps"] for r in overlap_report(model, reset=True).values())


def _batch(dp_rank: int = 0):
    """Two packed documents in one row (batch 1, as the trainer packs): the same on the TP ranks,
    one batch per data-parallel rank."""
    g = torch.Generator().manual_seed(2 + dp_rank)
    ids, labels = (torch.randint(0, 48, (BATCH, TOKENS), generator=g) for _ in range(2))
    return ids, labels, torch.tensor([0, 6, TOKENS], dtype=torch.int32)


def check_selective_under_tp(layouts: list[tuple[bool, bool]], lora: dict | None = None,
                             policy: str = "matmuls", fsdp: bool = False) -> dict:
    """Per (sequence_parallel, ring) layout and mode: the census, the backward's counts, the
    parity against float64 one process, and selective's exact equality with none.
    ``policy``: train.selective_checkpoint (matmuls / every_other_matmul); ``fsdp``: FSDP2 on a
    dp x tp = 2 x 2 mesh (4 ranks) on top (apply_fsdp, as the trainer does: after TP and
    checkpointing), each dp rank its own batch, gradients summed (the reference: both batches')."""
    import torch.utils.checkpoint as torch_checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.flop_counter import FlopCounterMode

    from xorl.parallel.activation_checkpointing import apply_activation_checkpointing
    from xorl.parallel.data_parallel import apply_fsdp
    from xorl.parallel.tensor_parallel import apply_tensor_parallel

    dp = 2 if fsdp else 1
    mesh_2d = init_device_mesh("cpu", (dp, dist.get_world_size() // dp), mesh_dim_names=("dp", "tp"))
    mesh, dp_rank = mesh_2d["tp"], mesh_2d.get_local_rank("dp")
    state = types.SimpleNamespace(fsdp_mesh=mesh_2d["dp"], ep_size=1, tp_size=mesh.size(), dp_replicate_size=1,
                                  ep_fsdp_mesh=None)
    base = build(llama_config(lora), seed=1)
    if lora:  # B starts at zero (peft): random, so the adapters' gradients are not trivial
        with torch.no_grad():
            for name, p in base.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)
    ref = copy.deepcopy(base).double()
    for other in range(dp):  # gradients of every dp rank's batch, summed (as FSDP sums them)
        other_ids, other_labels, other_cu = _batch(other)
        ref(other_ids, labels=other_labels, cu_seqlens=other_cu).loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    ids, labels, cu = _batch(dp_rank)
    results = {}
    for sp, ring in layouts:
        runs = {}
        for mode in ("none", "selective", "full"):
            model = copy.deepcopy(base)
            plan = apply_tensor_parallel(model, mesh, sequence_parallel=sp, overlap=ring,
                                         overlap_min_numel=0 if ring else 1 << 40)
            census = _Census()
            with mock.patch.object(torch_checkpoint, "create_selective_checkpoint_contexts",
                                   census.wrap(torch_checkpoint.create_selective_checkpoint_contexts)):
                if mode != "none":
                    apply_activation_checkpointing(model, mode, selective=policy)
                if fsdp:
                    apply_fsdp(model, state)
                out = model(ids, labels=labels, cu_seqlens=cu)
                census.read()
                _tp_comm(model)
                with FlopCounterMode(display=False) as flops, _CountOps() as ops:
                    out.loss.backward()
            sum_tp_partial_grads([plan.partial_grads])  # SP norms: each rank's tokens' share
            grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor()
                     for n, p in model.named_parameters() if p.grad is not None}
            runs[mode] = {
                "loss": out.loss.detach(), "grads": grads, "census": census.blocks,
                "backward_flops": flops.get_total_flops(), "backward_gemms_seen": ops.gemms,
                "backward_collectives": _tp_comm(model) + ops.collectives,
            }
        none, sel = runs["none"], runs["selective"]
        results[(sp, ring)] = {
            "census": sel["census"],
            "counts": {m: {k: r[k] for k in ("backward_flops", "backward_gemms_seen", "backward_collectives")}
                       for m, r in runs.items()},
            "selective_equals_none": bool(torch.equal(sel["loss"], none["loss"]) and all(
                torch.equal(sel["grads"][n], g) for n, g in none["grads"].items())),
            "grad_names_match": sorted(sel["grads"]) == sorted(ref_grads),
            "ref_errs": {"loss": rel_err(sel["loss"], ref(ids, labels=labels, cu_seqlens=cu).loss),
                         **{n: rel_err(sel["grads"][n], g) for n, g in ref_grads.items()}},
        }
    return results


# The kept bytes per block per rank, fp32 (4 bytes), t = BATCH * TOKENS tokens, TP 2. Under SP a
# row layer keeps its reduced [t/2, h] shard, without SP the all-reduced [t, h].
def expected_kept(sp: bool) -> list[tuple[str, list[tuple]]]:
    b, s, s_row = BATCH, TOKENS, TOKENS // 2 if sp else TOKENS
    q, kv, inter, heads = HQ // 2, HKV // 2, INTER // 2, HEADS // 2
    return [
        ("xorl.tp_column_linear.default", [((b, s, q), 4), ((b, s, kv), 4), ((b, s, kv), 4)]),
        ("xorl.flash_attn.default", [((b, s, heads, 4), 4), ((b, heads, s), 4)]),
        ("xorl.tp_row_linear.default", [((b, s_row, H), 4)]),
        ("xorl.tp_column_linear.default", [((b, s, inter), 4), ((b, s, inter), 4)]),
        ("xorl.tp_row_linear.default", [((b, s_row, H), 4)]),
    ]


def kept_bytes(kept) -> int:
    return sum(size * torch.Size(shape).numel() for _, outs in kept for shape, size in outs)


LAYOUTS = [(True, True), (True, False), (False, False)]  # (sequence_parallel, ring forced)
RECOMPUTE_FORBIDDEN = ("mm", "addmm", "bmm", "_scaled_mm", "c10d", "xorl.tp_", "flash_attn")


def test_selective_keeps_tp_linears_whole_and_recomputes_no_matmul_or_collective(gloo_world):
    for rank_result in gloo_world(2).run(check_selective_under_tp, LAYOUTS):
        for (sp, ring), r in rank_result.items():
            layout = f"sp={sp} ring={ring}"
            assert len(r["census"]) == 2, layout  # one cache per block (2 layers)
            for block in r["census"]:
                assert block["kept"] == expected_kept(sp), (layout, block["kept"])
                assert kept_bytes(block["kept"]) == (5760 if sp else 6784), layout
                recomputed_heavy = [op for op in block["recomputed"]
                                    if any(f in op for f in RECOMPUTE_FORBIDDEN)]
                assert recomputed_heavy == [], (layout, recomputed_heavy)
            counts = r["counts"]
            # Selective's backward runs exactly no checkpointing's GEMMs and collectives; full runs
            # every block's forward again (2 blocks x 7 GEMMs and their collectives).
            assert counts["selective"] == counts["none"], (layout, counts)
            assert counts["full"]["backward_flops"] > counts["none"]["backward_flops"], (layout, counts)
            assert counts["full"]["backward_collectives"] > counts["none"]["backward_collectives"], (layout, counts)
            assert r["selective_equals_none"], layout
            assert r["grad_names_match"], layout
            assert max(r["ref_errs"].values()) < 1e-5, (layout, r["ref_errs"])



LORA = {"rank": 2, "alpha": 4, "init_lora_weights": False,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def test_selective_with_lora_under_tp_recomputes_no_matmul_or_collective(gloo_world):
    region_op = {True: ("xorl.tp_all_gather.default", "xorl.tp_reduce_scatter.default"),
                 False: ("xorl.tp_all_reduce.default",)}  # column (SP) / row (SP); row without SP
    for rank_result in gloo_world(2).run(check_selective_under_tp, [(True, True), (False, False)], LORA):
        for (sp, ring), r in rank_result.items():
            layout = f"lora sp={sp} ring={ring}"
            for block in r["census"]:
                ops = [op for op, _ in block["kept"]]
                # every base layer kept whole, in order, and its adapter's collective output kept
                assert [op for op in ops if "tp_" in op and "linear" in op] == [
                    op for op, _ in expected_kept(sp) if "linear" in op], (layout, ops)
                assert {op for op in ops if op.startswith("xorl.tp_") and "linear" not in op} == set(
                    region_op[sp]), (layout, ops)
                recomputed_heavy = [op for op in block["recomputed"] if any(f in op for f in RECOMPUTE_FORBIDDEN)]
                assert recomputed_heavy == [], (layout, recomputed_heavy)
            counts = r["counts"]
            assert counts["selective"] == counts["none"], (layout, counts)
            assert counts["full"]["backward_collectives"] > counts["none"]["backward_collectives"], (layout, counts)
            assert r["selective_equals_none"] and r["grad_names_match"], layout
            assert max(r["ref_errs"].values()) < 1e-5, (layout, r["ref_errs"])


def test_every_other_matmul_counts_tp_gemms_in_block_order(gloo_world):
    for rank_result in gloo_world(2).run(check_selective_under_tp, [(True, True)], None, "every_other_matmul"):
        r = rank_result[(True, True)]
        for block in r["census"]:
            # GEMMs 1-3 (q, k, v: 1 and 3 kept) | 4 (o: recomputed) | 5-6 (gate, up) | 7 (down)
            kept = expected_kept(True)
            assert block["kept"] == kept[:2] + kept[3:], block["kept"]
            assert [op for op in block["recomputed"] if "tp_" in op] == ["xorl.tp_row_linear.default"]
        assert r["selective_equals_none"] and r["grad_names_match"]
        assert max(r["ref_errs"].values()) < 1e-5, r["ref_errs"]
        # o's GEMM and its reduce-scatter run again in backward (2 blocks), nothing else
        none, sel = r["counts"]["none"], r["counts"]["selective"]
        assert sel["backward_flops"] - none["backward_flops"] == 2 * 2 * TOKENS * (HQ // 2) * H
        assert sel["backward_collectives"] > none["backward_collectives"]


def test_selective_under_fsdp2_x_tp(gloo_world):
    # FSDP2 (dp 2 x tp 2 on 4 ranks, resharding after forward) around the checkpointed TP blocks:
    # the same cache, no GEMM or collective in the recompute, selective == none exactly.
    for rank_result in gloo_world(4).run(check_selective_under_tp, [(True, True)], None, "matmuls", True):
        r = rank_result[(True, True)]
        for block in r["census"]:
            assert block["kept"] == expected_kept(True), block["kept"]
            assert [op for op in block["recomputed"] if any(f in op for f in RECOMPUTE_FORBIDDEN)] == []
        assert r["counts"]["selective"] == r["counts"]["none"], r["counts"]
        assert r["selective_equals_none"] and r["grad_names_match"]
        assert max(r["ref_errs"].values()) < 1e-5, r["ref_errs"]
