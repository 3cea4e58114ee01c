"""train.fp8 under train.compile: the FP8 GEMMs are torch custom ops (xorl_kernels/fp8/linear.py
``xorl::fp8_linear``, grouped.py ``xorl::fp8_grouped_gemm``, and their backward ops), so a decoder block
with FP8 projections (and blockwise FP8 experts) compiles as one graph.

- The four ops pass torch.library.opcheck (schema, fake kernel against the real one, autograd
  registration, AOT autograd tracing), the float8-gathered weight's form (``weight_qscale``) too.
- A decoder block traces with 0 graph breaks under torch._dynamo.explain, every recipe, each FP8 GEMM
  one node of the traced forward and backward graphs (no cast, _scaled_mm or Triton kernel traced).
- One process, 3 steps of AdamW on a tiny Llama per recipe and a tiny Qwen3-MoE under blockwise,
  each block compiled as xorl/parallel/compile.py compiles it (fullgraph=True): the losses and every
  parameter's gradient at every step equal eager FP8 training's. aot_eager runs the traced aten ops
  and our ops' eager kernels, so they are bit for bit eager's: asserted exactly. inductor generates
  its own code for the element-wise work between the ops (and the bias gradient's sum); fp32
  re-association there moves a gradient by ~1e-8 relative (measured: 0 on the dense Llama, 2e-8 on
  the MoE, torch 2.13), and an FP8 cast that rounded differently because of it would move a
  gradient by ~1e-3 (an e4m3 step is 2^-3 relative for the element it flips): 1e-6 tells the two apart.
- Selective checkpointing (every_other_matmul) compiled with the block: the policy sees the FP8 ops
  inside the graph, and training still equals eager's exactly.
- The real Trainer on 2 gloo ranks: FSDP 2 with fp8_all_gather (torchao's Float8TrainingTensor weights
  enter the compiled blocks and reach the ops through their torch_dispatch rule), and TP 2 + SP, every
  recipe, with the overlapped ring forced on and with the plain collectives (the column ops' float8
  gathers and amax all-reduces inside them), compiled (aot_eager: inductor compiles for minutes on 2
  shared cores) against eager: no graph break; losses, gradient norms and final weights equal exactly.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support.compile_checks import decoder_block, graph_breaks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="FP8 needs torchao (pip install -e .[fp8])")
RECIPES = ("tensorwise", "rowwise", "blockwise")
SLOW_CALL_S = 540  # as tests/multirank/test_compile.py: compiling on 2 shared cores takes minutes


def test_fp8_ops_pass_opcheck():
    import xorl_kernels.fp8.grouped  # noqa: F401  (registers the ops)
    from xorl_kernels.fp8.quantize import E4M3, quantize_blocks

    ops, gen = torch.ops.xorl, torch.Generator().manual_seed(0)

    def rand(*shape, grad=True):
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    # K = 200 and N = 130: partial 128-blocks and a pad to 16 in every recipe; x 3-D as a block passes it
    x, w, b = rand(2, 9, 200), rand(130, 200), rand(130)
    dy = rand(2, 9, 130, grad=False)
    for recipe in RECIPES:
        for bias in (b, None):
            torch.library.opcheck(ops.fp8_linear.default, (x, w, bias, recipe))
        for need_dx, need_dw in ((True, True), (True, False), (False, True)):
            torch.library.opcheck(ops.fp8_linear_backward.default, (dy, x.detach(), w.detach(), recipe, need_dx,
                                                                    need_dw))
    # The weight as train.fp8_all_gather hands it over: its tensorwise e4m3 cast and quantisation factor
    # (test_schema left out: it multiplies each tensor input, and CPU has no float8 multiply kernel)
    q, scale = quantize_blocks(w.detach(), None, None, E4M3)
    qscale = scale.reciprocal().reshape(())
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.fp8_linear.default, (x, q, b, "tensorwise", qscale), test_utils=tests)
    torch.library.opcheck(ops.fp8_linear_backward.default, (dy, x.detach(), q, "tensorwise", True, True, qscale),
                          test_utils=tests)
    sizes = torch.tensor([130, 0, 170])  # an empty expert, token counts not multiples of 128
    xg, wg = rand(300, 200), rand(3, 200, 136)
    torch.library.opcheck(ops.fp8_grouped_gemm.default, (xg, wg, sizes, None))
    for need_dx, need_dw in ((True, True), (False, True)):
        torch.library.opcheck(ops.fp8_grouped_gemm_backward.default,
                              (rand(300, 136, grad=False), xg.detach(), wg.detach(), sizes, None, need_dx, need_dw))


def traced_ops(layer, inputs) -> list[list]:
    """The call_function targets of the forward and backward graphs AOT autograd traces of one
    fullgraph compile of ``layer(*inputs)`` and its backward."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    compiled = torch.compile(layer, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    try:
        out, _ = compiled(*inputs)
        out.sum().backward()
    finally:
        torch._dynamo.reset()
    return graphs


@pytest.mark.parametrize("model_type,fp8", [("llama", r) for r in RECIPES] + [("qwen3_moe", "blockwise")])
def test_an_fp8_decoder_block_traces_without_graph_breaks(model_type, fp8):
    layer, inputs = decoder_block(model_type, fp8=fp8)
    assert layer.self_attn.q_proj.fp8 == fp8
    count, reasons = graph_breaks(layer, inputs)
    assert count == 0, reasons
    # ... with each FP8 GEMM one node, forward and backward: nothing of its casts, torch._scaled_mm or
    # Triton kernels traced (on CPU the old autograd Function traced into its plain-torch casts and
    # _scaled_mm with no break either; on CUDA its Triton launches were what a graph could not hold).
    forward, backward = traced_ops(layer, inputs)
    ops, aten = torch.ops.xorl, torch.ops.aten
    linears, grouped = (4, 2) if model_type == "qwen3_moe" else (7, 0)  # q, k, v, o (gate, up, down); experts
    assert forward.count(ops.fp8_linear.default) == backward.count(ops.fp8_linear_backward.default) == linears
    assert forward.count(ops.fp8_grouped_gemm.default) == backward.count(ops.fp8_grouped_gemm_backward.default) \
        == grouped
    assert not {aten._scaled_mm.default, aten.abs.default, aten.amax.default} & set(forward + backward)


def train_steps(model_type: str, fp8: str, backend: str | None, steps: int = 3, selective: str | None = None):
    """(losses, [each parameter's gradient per step]) of a tiny model trained ``steps`` AdamW steps, each
    decoder block compiled with ``backend`` as xorl/parallel/compile.py compiles it (None: eager)."""
    from xorl.config import ModelConfig
    from xorl.models.registry import build_model
    from xorl.parallel.activation_checkpointing import apply_activation_checkpointing
    from xorl.parallel.compile import apply_compile

    m = ModelConfig(model_type=model_type, vocab_size=272, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if model_type == "qwen3_moe":
        m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size = 4, 2, 32
    torch.manual_seed(0)
    model = build_model(m, fp8=fp8)
    model.init_weights(seed=1)
    if selective is not None:
        apply_activation_checkpointing(model, "selective", 1, selective)
    if backend is not None:
        apply_compile(model, backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(2)
    losses, grads = [], []
    try:
        for _ in range(steps):
            rows = torch.randint(0, m.vocab_size, (1, 65), generator=gen)
            out = model(rows[:, :-1], labels=rows[:, 1:])
            (out.loss if out.router_loss is None else out.loss + out.router_loss).backward()
            losses.append(float(out.loss.detach()))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch._dynamo.reset()
    return losses, grads


def _rel(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys() and ref
    num = sum(float((got[k].double() - ref[k].double()).norm() ** 2) for k in ref)
    return (num / sum(float(ref[k].double().norm() ** 2) for k in ref)) ** 0.5


def _compare(model_type: str, fp8: str, backend: str, tolerance: float, selective: str | None = None) -> None:
    eager_losses, eager_grads = train_steps(model_type, fp8, None, selective=selective)
    losses, grads = train_steps(model_type, fp8, backend, selective=selective)
    assert len(eager_losses) == 3 and eager_losses[0] != eager_losses[-1]
    expert_grads = [g for g in eager_grads[0] if ".experts." in g]
    assert model_type != "qwen3_moe" or expert_grads  # the FP8 grouped GEMM's weights train
    errors = [_rel(g, e) for g, e in zip(grads, eager_grads)]
    print(model_type, fp8, backend, selective, "losses", losses, eager_losses, "grads rel", errors)
    if tolerance == 0:
        assert losses == eager_losses
        assert all(torch.equal(g[k], e[k]) for g, e in zip(grads, eager_grads) for k in e)
    else:
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses)) <= tolerance
        assert max(errors) <= tolerance


CASES = [("llama", r) for r in RECIPES] + [("qwen3_moe", "blockwise")]


@pytest.mark.parametrize("model_type,fp8", CASES)
def test_compiled_fp8_training_equals_eager_aot_eager(model_type, fp8):
    _compare(model_type, fp8, "aot_eager", 0.0)


@pytest.mark.slow  # inductor compiles its generated C++ in subprocesses: ~10-100 s a case on 2 cores
@pytest.mark.parametrize("model_type,fp8", CASES)
def test_compiled_fp8_training_equals_eager_inductor(model_type, fp8):
    _compare(model_type, fp8, "inductor", 1e-6)


def test_compiled_fp8_training_with_selective_checkpointing_equals_eager():
    """The checkpoint wrapper compiles with the block: every_other_matmul's policy runs on the traced
    graph, where each FP8 projection is one xorl::fp8_linear, kept or recomputed whole."""
    _compare("llama", "rowwise", "aot_eager", 0.0, selective="every_other_matmul")


# -- the real Trainer, 2 gloo ranks ----------------------------------------------------------------
def trainer_compiled_and_eager(output_dir: str, force_ring: bool = False, **train) -> dict:
    """Rank 0's train_and_report (losses, grad norms, final weights) eager and compiled (aot_eager).
    ``force_ring``: the TP linears take the overlapped ring at any size (the tiny model is below
    DEFAULT_OVERLAP_MIN_NUMEL), as tests/multirank/test_fp8_training.py's TP check forces it with
    overlap_min_numel=0."""
    from torch._dynamo.utils import counters

    from tests.support.parity_runs import tiny_config, train_and_report
    from xorl.nn.tp_matmul import TPMatmulConfig

    use_ring = TPMatmulConfig.use_ring
    if force_ring:  # restored below: the world is shared with other tests
        TPMatmulConfig.use_ring = lambda self, gathered_numel: self.overlap and self.tp.size > 1
    result = {}
    try:
        for setting in (False, "aot_eager"):
            config = tiny_config(f"{output_dir}/{setting}", "llama", max_steps=3, compile=setting, **train)
            config.model.num_hidden_layers = 2
            counters.clear()
            result[str(setting)] = train_and_report(config)
            result[f"{setting} breaks"] = [reason.splitlines()[0] for reason in counters["graph_break"]]
            torch._dynamo.reset()
    finally:
        TPMatmulConfig.use_ring = use_ring
        torch._dynamo.reset()
    return result


def _assert_equal_runs(result: dict) -> None:
    eager, compiled = result["False"], result["aot_eager"]
    assert result["aot_eager breaks"] == [], result["aot_eager breaks"]
    print("eager", eager["losses"], eager["grad_norms"], "compiled", compiled["losses"], compiled["grad_norms"])
    assert len(eager["losses"]) == 3 and eager["losses"][0] != eager["losses"][-1]
    assert compiled["losses"] == eager["losses"] and compiled["grad_norms"] == eager["grad_norms"]
    assert eager["weights"].keys() == compiled["weights"].keys()
    assert all(torch.equal(compiled["weights"][k], w) for k, w in eager["weights"].items())


def test_compiled_fp8_training_on_fsdp2_with_float8_all_gather_equals_eager(gloo_world, tmp_path):
    """FSDP 2, tensorwise, weights all-gathered in float8: the compiled blocks take torchao's
    Float8TrainingTensor parameters and hand their fields to xorl::fp8_linear."""
    result = gloo_world(2).run(trainer_compiled_and_eager, str(tmp_path), data_parallel_shard_size=2,
                               fp8="tensorwise", fp8_all_gather=True, timeout_s=SLOW_CALL_S)[0]
    _assert_equal_runs(result)


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "plain"])
@pytest.mark.parametrize("fp8", RECIPES)
def test_compiled_fp8_training_on_tp2_sp_equals_eager(fp8, ring, gloo_world, tmp_path):
    """TP 2 + SP: the TP linears are their own custom ops (xorl/nn/tp_linear_ops.py) whose column op casts
    its input shard once and gathers float8 (xorl/nn/tp_fp8.py: the amax all-reduces, the float8 ring or
    collective) inside; compiled (no graph break) and eager train alike."""
    result = gloo_world(2).run(trainer_compiled_and_eager, str(tmp_path), force_ring=ring, tp_overlap=ring,
                               data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True, fp8=fp8,
                               timeout_s=SLOW_CALL_S)[0]
    _assert_equal_runs(result)
