"""train.fp8 under TP 2 + sequence parallel: each column op casts its input's shard once and gathers
float8 (xorl/nn/tp_fp8.py), on 2 gloo ranks, every recipe, the plain collective and the overlapped ring
(forced on at these sizes with overlap_min_numel=0, as tests/multirank/test_fp8_training.py forces it).

* The gathered operand, forward x and the weight gradient's x^T: its float8 bytes and scales are the
  cast of the gathered tensor (plain) or each chunk's own cast (ring), bit for bit, on shards whose
  1 x 128 token tiles are each one rank's (s/P = 128), straddle ranks (s/P = 24, batch 2) and 2-D.
* The column op (3 members, two with a bias) and the row op: outputs and every gradient bit for bit
  those of the math xorl ran before (tests/support/tp_fp8_reference.py), and what each gather sends: 1 byte an
  element plus the scales that are not shared, counted from the shapes here.
* A tiny Llama (TP 2 + SP, FP8): logits, loss and every parameter's gradient bit for bit the old
  path's; the real Trainer's 3 steps: losses, gradient norms and final weights equal.
* The difference that was always there and stays: the ring casts each chunk with its own scales, the
  plain path with the whole tensor's; both measured against the float64 formula (printed).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="FP8 needs torchao (pip install -e .[fp8])")
RECIPES = ("tensorwise", "rowwise", "blockwise")
# Local input shards [..., s/P, K]: s/P = 128 keeps every 1 x 128 token tile on one rank; 24 with batch 2
# makes tiles straddle ranks and sequences; K = 160 a partial 128-wide block.
SHAPES = {"tiles_local": (1, 128, 160), "tiles_straddle": (2, 24, 160), "two_dim": (40, 96)}
OUT = (48, 40, 16)  # the column members' local widths (40: padded to 16 for _scaled_mm)


def _mesh_and_group():
    from torch.distributed.device_mesh import init_device_mesh

    from xorl.nn.tp_comm import TPGroup

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return mesh, TPGroup(mesh.get_group())


def _input(shape, seed: int, dtype) -> torch.Tensor:
    """The full [..., s, K] input (the same on every rank): channels and the second rank's half at
    different magnitudes, so per-rank, per-channel and per-tensor amaxes differ by powers of 2."""
    *lead, shard, k = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, 2 * shard, k, generator=gen) * torch.exp(torch.randn(k, generator=gen))
    x.narrow(-2, shard, shard).mul_(5.0)
    return x.to(dtype)


def _shard(t: torch.Tensor, rank: int, shard: int) -> torch.Tensor:
    return t.narrow(-2, rank * shard, shard).contiguous()


def _bits_equal(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:  # float8: compare the bytes (no float8 kernels on CPU)
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def check_gathered_operands(recipe: str) -> dict:
    """The float8 operand each path multiplies against quantize_operand of the gathered tensor (plain)
    or of each rank's chunk (ring)."""
    from xorl.nn import tp_fp8
    from xorl.nn.tp_matmul import TPMatmulConfig
    from xorl_kernels.fp8.linear import quantize_operand

    _, tp = _mesh_and_group()
    result = {}
    for name, shape in SHAPES.items():
        shard = shape[-2]
        x = _input(shape, 1, torch.bfloat16)
        rows = x.reshape(-1, x.shape[-1])
        local = _shard(x, tp.rank, shard)
        for ring in (False, True):
            cfg = TPMatmulConfig(tp, True, ring, 0, name=f"op {name} {ring}", fp8=recipe)
            for role in ("x", "x_t"):
                if not ring:
                    got = tp_fp8.gathered_input(cfg, local, role)
                    q, s, block = quantize_operand(rows if role == "x" else rows.t(), recipe, role)
                    result[(name, ring, role)] = _bits_equal(got.q, q) and _bits_equal(got.scale, s) \
                        and got.block == block
                    continue
                seen = {}

                def keep(op, src, seen=seen):
                    seen[src] = (op.q.clone(), op.scale.clone())

                tp_fp8.ring_input(cfg, local, role, keep)
                ok = sorted(seen) == [0, 1]
                for src, (q_got, s_got) in seen.items():
                    chunk = _shard(x, src, shard).reshape(-1, x.shape[-1])
                    q, s, _ = quantize_operand(chunk if role == "x" else chunk.t(), recipe, role)
                    ok = ok and _bits_equal(q_got, q) and _bits_equal(s_got, s)
                result[(name, ring, role)] = ok
    return result


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_gathered_float8_operand_is_the_cast_of_the_gathered_tensor(gloo_world, recipe):
    for rank, result in enumerate(gloo_world(2).run(check_gathered_operands, recipe)):
        assert result and all(result.values()), (rank, {k: v for k, v in result.items() if not v})


def _expected_bytes(recipe: str, shape, ring: bool, itemsize: int) -> dict:
    """What the column op sends, counted from the shapes (module docstring of xorl/nn/tp_fp8.py): forward
    its input's gather, backward the weight gradient's x^T gather and the input gradient's reduce-scatter.
    At P = 2 a gather sends the shard once, a reduce-scatter half its input, an all-reduce of n bytes n."""
    *lead, shard, k = shape
    m = math.prod(lead) * shard  # the shard's tokens
    x_scales = {"tensorwise": 4 if ring else 0, "rowwise": 4 * m, "blockwise": 4 * m * math.ceil(k / 128)}[recipe]
    amax_fwd = 4 if recipe == "tensorwise" and not ring else 0  # the scalar amax's all-reduce (max)
    if ring:  # each chunk's own scales travel with it
        xt_scales = {"tensorwise": 4, "rowwise": 4 * k, "blockwise": 4 * k * math.ceil(m / 128)}[recipe]
        amax_bwd = 0
    elif recipe == "blockwise" and shard % 128 == 0:  # every token tile on one rank: its scales travel
        xt_scales, amax_bwd = 4 * k * (m // 128), 0
    else:  # the gathered tensor's scales, known on every rank after an all-reduce of the amaxes
        xt_scales = 0
        amax_bwd = {"tensorwise": 4, "rowwise": 4 * k, "blockwise": 4 * k * math.ceil(2 * m / 128)}[recipe]
    return {"fwd": m * k + x_scales + amax_fwd, "bwd": k * m + xt_scales + amax_bwd + m * k * itemsize,
            "bf16_fwd": m * k * itemsize}


def check_column_and_row_ops(recipe: str) -> dict:
    """New column / row ops against tests/support/tp_fp8_reference.py (the old math): bits and bytes."""
    from tests.support import tp_fp8_reference as old
    from xorl.nn.tp_matmul import TPMatmulConfig, column_backward, column_forward, row_backward, row_forward

    _, tp = _mesh_and_group()
    dtype = torch.bfloat16
    result = {}
    for name, shape in SHAPES.items():
        *lead, shard, k = shape
        x = _input(shape, 2, dtype)
        local = _shard(x, tp.rank, shard)
        gen = torch.Generator().manual_seed(3)
        ws = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for n in OUT]
        bs = [torch.randn(OUT[0], generator=gen).to(dtype), None, torch.randn(OUT[2], generator=gen).to(dtype)]
        gs = [torch.randn(*lead, 2 * shard, n, generator=gen).to(dtype) for n in OUT]
        w_row = (torch.randn(k, OUT[0], generator=gen) / OUT[0] ** 0.5).to(dtype)
        g_row = torch.randn(*lead, shard, k, generator=gen).to(dtype)
        for ring in (False, True):
            cfg = TPMatmulConfig(tp, True, ring, 0, name=f"col {name} {ring}", fp8=recipe)
            ref = TPMatmulConfig(tp, True, ring, 0, name=f"ref {name} {ring}", fp8=recipe)
            stats = cfg.stats
            outs = column_forward(cfg, local, ws, bs)
            sent_fwd = stats.sent_bytes
            dx, dws = column_backward(cfg, local, ws, gs, True, [True, True, False])
            sent_bwd = stats.sent_bytes - sent_fwd
            outs_ref = old.column_forward(ref, local, ws, bs)
            dx_ref, dws_ref = old.column_backward(ref, local, ws, gs, True, [True, True, False])
            h = outs[0]  # the row op takes the first member's output as its [.., s, n] input
            y = row_forward(cfg, h, w_row, None)
            rdx, rdw, _ = row_backward(cfg, h, w_row, g_row, True, True, False)
            y_ref = old.row_forward(ref, h, w_row, None)
            rdx_ref, rdw_ref, _ = old.row_backward(ref, h, w_row, g_row, True, True, False)
            result[(name, ring)] = {
                "outs": all(_bits_equal(a, b) for a, b in zip(outs, outs_ref)),
                "dx": _bits_equal(dx, dx_ref),
                "dws": all(_bits_equal(a, b) for a, b in zip(dws, dws_ref)) and dws[2] is None,
                "row": _bits_equal(y, y_ref) and _bits_equal(rdx, rdx_ref) and _bits_equal(rdw, rdw_ref),
                "sent": {"fwd": sent_fwd, "bwd": sent_bwd},
                "expected": _expected_bytes(recipe, shape, ring, dtype.itemsize),
            }
    return result


@pytest.mark.parametrize("recipe", RECIPES)
def test_column_and_row_ops_equal_the_old_math_bit_for_bit_and_send_float8(gloo_world, recipe):
    for rank, result in enumerate(gloo_world(2).run(check_column_and_row_ops, recipe)):
        for case, r in result.items():
            print(recipe, rank, case, r["sent"], r["expected"])
            assert r["outs"] and r["dx"] and r["dws"] and r["row"], (rank, case, r)
            assert r["sent"]["fwd"] == r["expected"]["fwd"], (rank, case, r)
            assert r["sent"]["bwd"] == r["expected"]["bwd"], (rank, case, r)
            assert r["sent"]["fwd"] < 0.6 * r["expected"]["bf16_fwd"]  # bf16 sent 2 bytes an element
            # xorl-plan's count of the same gathers (xorl/planner/fp8_time.py column_gather, the whole
            # gathered tensor's bytes: a rank sends half of it at P = 2, and an all-reduce's n bytes)
            from xorl.planner.fp8_time import column_gather

            *lead, shard, k = SHAPES[case[0]]
            m = math.prod(lead) * shard
            g = column_gather(recipe, 2 * m, k, 2, case[1], shard % 128 == 0)
            assert g.forward / 2 + g.forward_reduce == r["sent"]["fwd"], (case, g, r)
            assert g.backward / 2 + g.backward_reduce + 2 * m * k == r["sent"]["bwd"], (case, g, r)


def check_precision_of_both_paths(recipe: str) -> dict:
    """Relative error of the column op's output and weight gradient against the float64 formula, the
    plain path (the whole tensor's scales) and the ring (each chunk's)."""
    from xorl.nn.tp_matmul import TPMatmulConfig, column_backward, column_forward

    _, tp = _mesh_and_group()
    errors = {}
    for name, shape in SHAPES.items():
        *lead, shard, k = shape
        x = _input(shape, 4, torch.float32)
        gen = torch.Generator().manual_seed(5)
        w = torch.randn(OUT[0], k, generator=gen) / k**0.5
        g = torch.randn(*lead, 2 * shard, OUT[0], generator=gen)
        y64 = x.double() @ w.double().t()
        dw64 = g.double().reshape(-1, OUT[0]).t() @ x.double().reshape(-1, k)
        got = {}
        for ring in (False, True):
            cfg = TPMatmulConfig(tp, True, ring, 0, name=f"p {name} {ring}", fp8=recipe)
            (y,) = column_forward(cfg, _shard(x, tp.rank, shard), [w], [None])
            _, (dw,) = column_backward(cfg, _shard(x, tp.rank, shard), [w], [g], False, [True])
            got[ring] = (y.double(), dw.double())
            errors[(name, "ring" if ring else "plain")] = (
                float((y.double() - y64).norm() / y64.norm()), float((dw.double() - dw64).norm() / dw64.norm()))
        errors[(name, "ring - plain")] = tuple(float((a - b).norm() / b.norm()) for a, b in zip(got[True], got[False]))
    return errors


@pytest.mark.parametrize("recipe", RECIPES)
def test_plain_and_ring_casts_against_float64(gloo_world, recipe):
    errors = gloo_world(2).run(check_precision_of_both_paths, recipe)[0]
    for case, (out, dw) in errors.items():
        print(f"{recipe} {case}: output {out:.3e}, weight gradient {dw:.3e}")
        if case[1] != "ring - plain":
            assert 1e-4 < out < 0.1 and 1e-4 < dw < 0.1, (case, out, dw)  # FP8 ran, and within FP8's error


# -- a tiny Llama, TP 2 + SP ----------------------------------------------------------------------------
def _llama(recipe: str, seed: int):
    import types

    from xorl.models.registry import build_model

    config = types.SimpleNamespace(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation="torch", max_position_embeddings=512)
    torch.manual_seed(seed)
    return build_model(config, fp8=recipe).float()


def check_llama_bits(recipe: str) -> dict:
    """Logits, loss and every parameter's gradient of the TP 2 + SP FP8 Llama, new against old."""
    import copy

    from tests.support.tp_fp8_reference import reference_tp_linears
    from xorl.parallel.tensor_parallel import apply_tensor_parallel

    mesh, _ = _mesh_and_group()
    base = _llama(recipe, 1)
    result = {}
    for batch, seq in ((1, 256), (2, 24)):  # s/P = 128: token tiles local; 12: straddling
        ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seq))
        labels = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seq + 1))
        for ring in (False, True):
            runs = []
            for reference in (False, True):
                model = copy.deepcopy(base)
                apply_tensor_parallel(model, mesh, sequence_parallel=True, overlap=ring, overlap_min_numel=0)
                with reference_tp_linears() if reference else _nothing():
                    loss = model(ids, labels=labels).loss
                    loss.backward()
                    with torch.no_grad():
                        logits = model(ids).logits
                runs.append({"loss": loss.detach(), "logits": logits,
                             **{n: p.grad.to_local() for n, p in model.named_parameters()}})
            new, ref = runs
            assert new.keys() == ref.keys()
            result[(batch, seq, ring)] = [k for k in ref if not torch.equal(new[k], ref[k])]
    return result


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_tp_llama_in_fp8_equals_the_old_path_bit_for_bit(gloo_world, recipe):
    for rank, result in enumerate(gloo_world(2).run(check_llama_bits, recipe)):
        assert all(diff == [] for diff in result.values()), (rank, result)


def train_old_and_new(output_dir: str, recipe: str, ring: bool) -> dict:
    """Rank 0's train_and_report (3 steps, TP 2 + SP, FP8) with the new ops and with the old math."""
    from tests.support.parity_runs import tiny_config, train_and_report
    from tests.support.tp_fp8_reference import reference_tp_linears
    from xorl.nn.tp_matmul import TPMatmulConfig

    use_ring = TPMatmulConfig.use_ring
    if ring:  # the tiny model is below DEFAULT_OVERLAP_MIN_NUMEL (restored: the world is shared)
        TPMatmulConfig.use_ring = lambda self, gathered_numel: self.overlap and self.tp.size > 1
    result = {}
    try:
        for reference in (False, True):
            config = tiny_config(f"{output_dir}/{ring}{reference}", "llama", max_steps=3, data_parallel_shard_size=1,
                                 tensor_parallel_size=2, sequence_parallel=True, tp_overlap=ring, fp8=recipe)
            config.model.num_hidden_layers = 2
            with reference_tp_linears() if reference else _nothing():
                result["old" if reference else "new"] = train_and_report(config)
    finally:
        TPMatmulConfig.use_ring = use_ring
    return result


@pytest.mark.parametrize("recipe", RECIPES)
def test_training_losses_equal_the_old_path(gloo_world, tmp_path, recipe):
    for ring in (False, True):
        result = gloo_world(2).run(train_old_and_new, str(tmp_path), recipe, ring, timeout_s=300)[0]
        new, old = result["new"], result["old"]
        print(recipe, ring, new["losses"], old["losses"])
        assert len(new["losses"]) == 3 and new["losses"][0] != new["losses"][-1]
        assert new["losses"] == old["losses"] and new["grad_norms"] == old["grad_norms"]
        assert all(torch.equal(new["weights"][k], w) for k, w in old["weights"].items())
