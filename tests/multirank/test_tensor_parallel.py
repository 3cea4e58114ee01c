"""ColumnParallelLinear / RowParallelLinear against single-process nn.Linear (float64), on 4 gloo ranks.

TP=4 uses the whole world as one TP group; TP=2 uses the tp dim of a (2, 2) mesh (two independent
TP pairs run the same check). Every combination of sequence parallel and overlap is compared:
forward, the input gradient and every weight / bias gradient (DTensor ``full_tensor()``).
The overlap checks count the P2P calls independently (by wrapping ``batch_isend_irecv``).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from xorl.nn.tp_comm import overlap_report

TOL = 1e-5


def tp_mesh(tp_size: int):
    """A 1-D TP mesh of ``tp_size`` ranks (a collective; the harness destroys it after the check)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if tp_size == world:
        return init_device_mesh("cpu", (tp_size,), mesh_dim_names=("tp",))
    return init_device_mesh("cpu", (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))["tp"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def fp32(linear: nn.Linear) -> nn.Linear:
    """An fp32 copy (the float64 reference keeps its own weights and gradients)."""
    return copy.deepcopy(linear).float()


def seq_chunk(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=-2)[rank]


def _count_p2p_calls():
    """Wrap dist.batch_isend_irecv; returns (counter dict, restore fn)."""
    counter = {"calls": 0, "ops": 0}
    original = dist.batch_isend_irecv

    def counting(ops):
        counter["calls"] += 1
        counter["ops"] += len(ops)
        return original(ops)

    dist.batch_isend_irecv = counting
    return counter, lambda: setattr(dist, "batch_isend_irecv", original)


def check_column_row_chain(tp_size: int, shape_prefix: tuple[int, ...]) -> dict:
    """x -> Column(in->mid) -> Row(mid->out) for every (sp, overlap); errors + P2P counts per case."""
    from xorl.nn import ColumnParallelLinear, RowParallelLinear

    mesh = tp_mesh(tp_size)
    rank = mesh.get_local_rank()
    hidden, mid, seq = 6, 8 * tp_size // 2, 4 * tp_size
    results = {}
    for case, (sp, overlap) in enumerate(itertools.product([True, False], [True, False])):
        torch.manual_seed(100 + case)  # same on every rank: identical full weights and inputs
        ref_col, ref_row = nn.Linear(hidden, mid).double(), nn.Linear(mid, hidden).double()
        x = torch.randn(*shape_prefix, seq, hidden, dtype=torch.float64)
        g = torch.randn(*shape_prefix, seq, hidden, dtype=torch.float64)  # upstream gradient
        x_ref = x.clone().requires_grad_(True)
        h_ref = ref_col(x_ref)
        y_ref = ref_row(h_ref)
        (y_ref * g).sum().backward()

        col = ColumnParallelLinear.from_linear(fp32(ref_col), mesh, sequence_parallel=sp, overlap=overlap,
                                               overlap_min_numel=0, name=f"col{case}")
        row = RowParallelLinear.from_linear(fp32(ref_row), mesh, sequence_parallel=sp, overlap=overlap,
                                            overlap_min_numel=0, name=f"row{case}")
        x_local = (seq_chunk(x, rank, tp_size) if sp else x).float().clone().requires_grad_(True)
        counter, restore = _count_p2p_calls()
        try:
            h = col(x_local)
            y = row(h)
            fwd_calls = counter["calls"]
            g_local = seq_chunk(g, rank, tp_size) if sp else g
            (y * g_local.float()).sum().backward()
            bwd_calls = counter["calls"] - fwd_calls
        finally:
            restore()
        mid_cols = slice(rank * mid // tp_size, (rank + 1) * mid // tp_size)
        y_expect = seq_chunk(y_ref, rank, tp_size) if sp else y_ref
        dx_expect = seq_chunk(x_ref.grad, rank, tp_size) if sp else x_ref.grad
        errs = {
            "col_out": rel_err(h, h_ref[..., mid_cols]),
            "row_out": rel_err(y, y_expect),
            "dx": rel_err(x_local.grad, dx_expect),
            "col_dw": rel_err(col.weight.grad.full_tensor(), ref_col.weight.grad),
            "col_db": rel_err(col.bias.grad.full_tensor(), ref_col.bias.grad),
            "row_dw": rel_err(row.weight.grad.full_tensor(), ref_row.weight.grad),
            "row_db": rel_err(row.bias.grad.full_tensor(), ref_row.bias.grad),
        }
        report = overlap_report(col, row)
        results[(sp, overlap)] = {
            "errs": errs, "fwd_calls": fwd_calls, "bwd_calls": bwd_calls,
            "col": report[col.name], "row": report[row.name],
            "grad_placements": (col.weight.grad.placements, row.weight.grad.placements),
        }
        overlap_report(col, row, reset=True)
    return results


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("shape_prefix", [(2,), ()], ids=["bsh", "sh"])
def test_column_row_match_single_process(gloo_world, tp_size, shape_prefix):
    world = gloo_world(4)
    for rank, results in enumerate(world.run(check_column_row_chain, tp_size, shape_prefix)):
        for (sp, overlap), r in results.items():
            for what, err in r["errs"].items():
                assert err <= TOL, f"rank {rank} tp={tp_size} sp={sp} overlap={overlap}: {what} rel err {err:.2e}"
            ring = sp and overlap
            steps = tp_size - 1
            # An independent count of the P2P exchanges: one ring per gather / scatter, P-1 steps each.
            # fwd: column gather + row scatter; bwd: column re-gather + column scatter + row gather.
            assert r["fwd_calls"] == (2 * steps if ring else 0), (sp, overlap, r)
            assert r["bwd_calls"] == (3 * steps if ring else 0), (sp, overlap, r)
            assert r["col"]["ring_steps"] == (3 * steps if ring else 0)
            assert r["col"]["p2p_ops"] == 2 * r["col"]["ring_steps"]
            assert r["col"]["chunk_gemms"] == (3 * tp_size if ring else 0)
            assert r["row"]["ring_steps"] == (2 * steps if ring else 0)
            # plain collectives: SP no overlap: col AG fwd, AG + RS bwd; row RS fwd, AG + bias AR bwd.
            # no SP: col all-reduce dx; row all-reduce output.
            expect_col = {(True, True): 0, (True, False): 3, (False, True): 1, (False, False): 1}[(sp, overlap)]
            expect_row = {(True, True): 1, (True, False): 3, (False, True): 1, (False, False): 1}[(sp, overlap)]
            assert r["col"]["collectives"] == expect_col, r["col"]
            assert r["row"]["collectives"] == expect_row, r["row"]
            assert r["col"]["exposed_ms"] is None  # CPU: not recorded
            assert str(r["grad_placements"][0]) == "(Shard(dim=0),)"
            assert str(r["grad_placements"][1]) == "(Shard(dim=1),)"


def check_shared_group_and_cutoff(tp_size: int) -> dict:
    """q/k/v sharing one gather (one output unused) == three nn.Linear; the size cutoff picks plain path."""
    from xorl.nn import ColumnParallelLinear
    from xorl.nn.tp_linear import SharedInputColumnGroup

    mesh = tp_mesh(tp_size)
    rank = mesh.get_local_rank()
    torch.manual_seed(7)
    hidden, seq = 8, 2 * tp_size
    refs = [nn.Linear(hidden, n, bias=bias).double() for n, bias in [(8, True), (4, False), (4, True)]]
    x = torch.randn(2, seq, hidden, dtype=torch.float64)
    gs = [torch.randn(2, seq, r.out_features, dtype=torch.float64) for r in refs]
    x_ref = x.clone().requires_grad_(True)
    outs_ref = [r(x_ref) for r in refs]
    # The third output is unused downstream: its gradient is zero, and must stay so.
    sum((o * g).sum() for o, g in zip(outs_ref[:2], gs[:2])).backward()

    errs, counts = {}, {}
    for overlap, min_numel in [(True, 0), (False, 0), (True, 10**9)]:
        layers = [ColumnParallelLinear.from_linear(fp32(r), mesh, sequence_parallel=True, overlap=overlap,
                                                   overlap_min_numel=min_numel) for r in refs]
        group = SharedInputColumnGroup(layers, name=f"qkv-{overlap}-{min_numel}")
        x_local = seq_chunk(x, rank, tp_size).float().clone().requires_grad_(True)
        counter, restore = _count_p2p_calls()
        try:
            outs = [layer(x_local) for layer in layers]
            fwd_calls = counter["calls"]
            cols = [slice(rank * r.out_features // tp_size, (rank + 1) * r.out_features // tp_size) for r in refs]
            sum((o * g[..., c].float()).sum() for o, g, c in zip(outs[:2], gs[:2], cols[:2])).backward()
        finally:
            restore()
        key = (overlap, min_numel)
        errs[key] = {f"out{j}": rel_err(o, r[..., c]) for j, (o, r, c) in enumerate(zip(outs, outs_ref, cols))}
        errs[key]["dx"] = rel_err(x_local.grad, seq_chunk(x_ref.grad, rank, tp_size))
        for j, (layer, r) in enumerate(zip(layers[:2], refs[:2])):
            errs[key][f"dw{j}"] = rel_err(layer.weight.grad.full_tensor(), r.weight.grad)
        errs[key]["db0"] = rel_err(layers[0].bias.grad.full_tensor(), refs[0].bias.grad)
        unused = layers[2].weight.grad
        counts[key] = {
            "fwd_calls": fwd_calls, "total_calls": counter["calls"],
            "unused_grad_max": 0.0 if unused is None else unused.full_tensor().abs().max().item(),
            "report": overlap_report(*layers)[group.config.name],
        }
        overlap_report(*layers, reset=True)
    return {"errs": errs, "counts": counts}


def test_shared_input_group_gathers_once_and_cutoff(gloo_world):
    world = gloo_world(4)
    for tp_size in (2, 4):
        for rank, result in enumerate(world.run(check_shared_group_and_cutoff, tp_size)):
            for key, errs in result["errs"].items():
                for what, err in errs.items():
                    assert err <= TOL, f"rank {rank} tp={tp_size} {key}: {what} rel err {err:.2e}"
            steps = tp_size - 1
            ring = result["counts"][(True, 0)]
            # One gather ring for three layers forward; re-gather + reduce-scatter backward.
            assert ring["fwd_calls"] == steps and ring["total_calls"] == 3 * steps, ring
            assert ring["unused_grad_max"] == 0.0
            for plain in [(False, 0), (True, 10**9)]:  # overlap off, or below the size cutoff
                c = result["counts"][plain]
                assert c["total_calls"] == 0 and c["report"]["ring_steps"] == 0, (plain, c)
                assert c["report"]["collectives"] == 3, (plain, c)  # AG fwd; AG + RS bwd


def check_regions_and_errors(tp_size: int) -> dict:
    """split/gather regions and gather_output / input_is_parallel=False; clear errors on bad input."""
    from xorl.nn import ColumnParallelLinear, RowParallelLinear

    mesh = tp_mesh(tp_size)
    rank = mesh.get_local_rank()
    torch.manual_seed(11)
    ref_col, ref_row = nn.Linear(6, 8).double(), nn.Linear(8, 6).double()
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    g = torch.randn(3, 5, 6, dtype=torch.float64)
    x_ref = x.clone().requires_grad_(True)
    (ref_row(ref_col(x_ref)) * g).sum().backward()
    col = ColumnParallelLinear.from_linear(fp32(ref_col), mesh, gather_output=True)
    row = RowParallelLinear.from_linear(fp32(ref_row), mesh, input_is_parallel=False)
    x_in = x.float().clone().requires_grad_(True)
    y = row(col(x_in))  # full hidden between them: gather_output -> split again
    (y * g.float()).sum().backward()
    errs = {
        "out": rel_err(y, ref_row(ref_col(x))),
        "dx": rel_err(x_in.grad, x_ref.grad),
        "col_dw": rel_err(col.weight.grad.full_tensor(), ref_col.weight.grad),
        "row_dw": rel_err(row.weight.grad.full_tensor(), ref_row.weight.grad),
    }
    messages = {}
    for name, make in {
        "indivisible": lambda: ColumnParallelLinear(6, 7, tp_mesh=mesh),
        "no_mesh": lambda: RowParallelLinear(8, 6),
        "bad_seq": lambda: RowParallelLinear(8, 6, tp_mesh=mesh, sequence_parallel=True)(
            torch.randn(1, tp_size + 1, 8 // tp_size)),
        "wrong_width": lambda: RowParallelLinear(8, 6, tp_mesh=mesh)(torch.randn(2, 8)),
    }.items():
        try:
            make()
            messages[name] = None
        except (ValueError, TypeError) as e:
            messages[name] = str(e)
    return {"errs": errs, "messages": messages, "rank": rank}


def test_gather_output_and_replicated_input_and_errors(gloo_world):
    world = gloo_world(4)
    for tp_size in (2, 4):
        for result in world.run(check_regions_and_errors, tp_size):
            for what, err in result["errs"].items():
                assert err <= TOL, f"tp={tp_size}: {what} rel err {err:.2e}"
            m = result["messages"]
            assert m["indivisible"] and "out_features=7" in m["indivisible"]
            assert m["no_mesh"] and "tp_mesh must be a 1-D DeviceMesh" in m["no_mesh"]
            assert m["bad_seq"] and "not divisible by tensor_parallel_size" in m["bad_seq"]
            assert m["wrong_width"] and "input_is_parallel=False" in m["wrong_width"]


@pytest.mark.gpu
def test_chunked_weight_gradient_accumulates_in_one_fp32_buffer():
    """bf16 chunks of a TP weight gradient: one fp32 buffer (no bf16 partial of the shard's size per
    chunk), closer to the float64 sum than a bf16 sum of chunks."""
    from xorl.nn.tp_matmul import _accumulate_wgrad

    torch.manual_seed(0)
    chunks, out_f, in_f, rows = 8, 1024, 2048, 512
    g = [torch.randn(rows, out_f, device="cuda", dtype=torch.bfloat16) for _ in range(chunks)]
    x = [torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(chunks)]
    ref = sum(gi.double().t() @ xi.double() for gi, xi in zip(g, x))
    acc = _accumulate_wgrad(None, g[0], x[0])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for gi, xi in zip(g[1:], x[1:]):
        acc = _accumulate_wgrad(acc, gi, xi)
    torch.cuda.synchronize()
    assert acc.dtype == torch.float32
    # No temporary the size of the shard (bf16: 4 MiB here) beyond cuBLAS workspace.
    assert torch.cuda.max_memory_allocated() - base < out_f * in_f * 2 // 2
    err = ((acc.double() - ref).norm() / ref.norm()).item()
    bf16_sum = sum((gi.t() @ xi) for gi, xi in zip(g, x))
    err_bf16 = ((bf16_sum.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-3 and err < err_bf16, (err, err_bf16)
