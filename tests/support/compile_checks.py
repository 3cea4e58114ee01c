"""Check functions for tests/multirank/test_compile.py: a decoder block under torch._dynamo.explain, the
custom ops under torch.library.opcheck, and the trainer compiled and eager.

Module-level so they travel to gloo ranks by pickle (xorl/testing/multirank.py). Every check
restores the dynamo settings it changes and resets dynamo's caches: the worlds are shared.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

SEQ = 16  # tokens per rank


def decoder_block(model_type: str, attn: str = "xorl", ring=None, ulysses=None, ep=None, moe_plan: bool = True,
                  lora: dict | None = None, fp8: str = "none"):
    """(layer 0 of a tiny model with the given parallel plans, its inputs). With ring / Ulysses the
    inputs are this rank's SEQ tokens and cu_seqlens the GLOBAL boundaries (documents of 8 and the rest).
    ``fp8``: the model's train.fp8 recipe (its projections, and under blockwise its experts, in FP8)."""
    from xorl.config import ModelConfig
    from xorl.models.registry import build_model
    from xorl.parallel.context_parallel import apply_context_parallel
    from xorl.parallel.expert_parallel import apply_expert_parallel

    torch.manual_seed(0)
    moe = model_type == "qwen3_moe"
    config = ModelConfig(model_type=model_type, attn_implementation=attn, num_experts=4 if moe else 0, lora=lora)
    model = build_model(config, fp8=fp8)
    if moe and moe_plan:
        ep_mesh = None
        if ep is not None:  # the experts become DTensors over an "ep" mesh of ep's ranks
            from torch.distributed.device_mesh import init_device_mesh

            ep_mesh = init_device_mesh("cpu", (dist.get_world_size(ep),), mesh_dim_names=("ep",))
        apply_expert_parallel(model, ep_mesh)
    if ring is not None or ulysses is not None:
        apply_context_parallel(model, ring_group=ring, ulysses_group=ulysses)
    cp = 1 if ring is None and ulysses is None else dist.get_world_size()
    hidden = torch.randn(1, SEQ, config.hidden_size, requires_grad=True)
    cos, sin = model.model.rotary_emb(torch.arange(SEQ)[None], hidden.dtype)
    total = SEQ * cp
    cu = torch.tensor([0, 8, total], dtype=torch.int32)
    return model.model.layers[0], (hidden, cos, sin, cu, total - 8)


def graph_breaks(layer, inputs, capture_scalar_outputs: bool = False) -> tuple[int, list[str]]:
    """(graph breaks torch._dynamo.explain finds in ``layer(*inputs)``, their reasons)."""
    with torch._dynamo.config.patch(capture_scalar_outputs=capture_scalar_outputs):
        try:
            explanation = torch._dynamo.explain(layer)(*inputs)
        finally:
            torch._dynamo.reset()
    return explanation.graph_break_count, [b.reason.splitlines()[0] for b in explanation.break_reasons]


PARALLEL_CASES = {
    "dense ring": dict(model_type="llama", ring=True),
    "dense ulysses": dict(model_type="llama", ulysses=True),
    "moe ep": dict(model_type="qwen3_moe", ep=True),
    "moe ep ring": dict(model_type="qwen3_moe", ep=True, ring=True),
    "moe ep fp8 blockwise": dict(model_type="qwen3_moe", ep=True, fp8="blockwise"),  # unbacked expert rows
}


def parallel_block_breaks(case: str) -> tuple[int, list[str]]:
    """Graph breaks of a decoder block on this world (PARALLEL_CASES; the groups: the whole world)."""
    groups = {name: dist.group.WORLD for name, on in PARALLEL_CASES[case].items() if on is True}
    kwargs = {**PARALLEL_CASES[case], **groups}
    # EP's split sizes are host ints: traced as unbacked sizes, as xorl/parallel/compile.py arranges.
    return graph_breaks(*decoder_block(**kwargs), capture_scalar_outputs="ep" in groups)


def opcheck_parallel_ops() -> list[str]:
    """torch.library.opcheck of the CP / EP custom ops on a 2-rank world; returns the ops checked."""
    import xorl.nn.ep_dispatch  # noqa: F401  (registers xorl::ep_*)
    import xorl.nn.ring_attention  # noqa: F401
    import xorl.nn.ulysses_attention  # noqa: F401

    name = dist.group.WORLD.group_name
    torch.manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, 8, h, 4, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 8, 16])
    ops = torch.ops.xorl
    ring = ops.ring_attention.default  # q, k, v, sinks, cu, max_seqlen, group, causal, scale, dkv, backend, window
    torch.library.opcheck(ring, (q, k, v, None, cu, 8, name, True, None, torch.float32, None, None))
    torch.library.opcheck(ring, (q, k, v, None, None, None, name, False, 0.5, torch.float32, None, None))
    sinks, narrow_v = torch.randn(4, requires_grad=True), torch.randn(1, 8, 2, 3, requires_grad=True)
    torch.library.opcheck(ring, (q, k, narrow_v, sinks, cu, 8, name, True, None, torch.float32, None, 3))
    torch.library.opcheck(ops.ulysses_seq_to_head.default, ([q, k, v], name, 2))
    torch.library.opcheck(ops.ulysses_head_to_seq.default, ([torch.randn(1, 16, 2, 4, requires_grad=True)], name, 2))
    counts = torch.tensor([[1, 2], [3, 0]]) if dist.get_rank() == 0 else torch.tensor([[2, 2], [1, 1]])
    torch.library.opcheck(ops.ep_exchange_counts.default, (counts, name))
    recv = ops.ep_exchange_counts(counts, name)
    rows = torch.randn(int(counts.sum()), 4, requires_grad=True)
    torch.library.opcheck(
        ops.ep_all_to_all.default, (rows, recv.sum(1).tolist(), counts.sum(1).tolist(), name),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),  # see test_compile.py
    )
    return ["ring_attention", "ulysses_seq_to_head", "ulysses_head_to_seq", "ep_exchange_counts", "ep_all_to_all"]


def train_compiled_and_eager(output_dir: str, model_type: str, steps: int, compile_backend, lora: dict | None = None,
                             **train) -> dict:
    """Losses of the real Trainer eager and with train.compile, on every rank; seconds each took."""
    from tests.support.parity_runs import tiny_config, train_losses

    result = {}
    for setting in (False, compile_backend):
        config = tiny_config(f"{output_dir}/{setting}", model_type, max_steps=steps, compile=setting, **train)
        config.model.num_hidden_layers = 2
        config.model.lora = lora
        start = time.perf_counter()
        # apply_compile may turn these on, process-wide
        with torch._dynamo.config.patch(capture_scalar_outputs=False,
                                        skip_fwd_side_effects_in_bwd_under_checkpoint=False):
            try:
                result[str(setting)] = train_losses(config)
            finally:
                torch._dynamo.reset()
        result[f"{setting} seconds"] = time.perf_counter() - start
    return result


def train_and_count(output_dir: str, model_type: str, steps: int, backend: str, lora: dict | None = None,
                    layers: int = 2, eager: bool = True, **train) -> dict:
    """The real Trainer eager (if ``eager``) and compiled: each run's losses, and what dynamo did in the
    compiled one: graphs made, graph breaks (their reasons), the blocks that ran outside a graph
    (xorl/parallel/compile.py CompileRecord), and how many kinds of block (dense / MoE) the model has."""
    from torch._dynamo.utils import counters

    from tests.support.parity_runs import tiny_config
    from xorl.parallel.data_parallel import decoder_layers
    from xorl.trainer.trainer import Trainer

    result = {}
    for setting in ((False,) if eager else ()) + (backend,):
        config = tiny_config(f"{output_dir}/{setting}", model_type, max_steps=steps, compile=setting, **train)
        config.model.num_hidden_layers = layers
        config.model.lora = lora
        torch._dynamo.reset()
        counters.clear()
        # apply_compile sets these process-wide; the shared world gets them back as they were.
        with torch._dynamo.config.patch(capture_scalar_outputs=False,
                                        skip_fwd_side_effects_in_bwd_under_checkpoint=False):
            try:
                trainer = Trainer(config)
                result[str(setting)] = [r.loss for r in trainer.train()]
                if setting:
                    result["graphs"] = counters["stats"]["unique_graphs"]
                    result["breaks"] = [reason.splitlines()[0] for reason in counters["graph_break"]]
                    result["ran_eager"] = sorted(i for part in trainer.step_plan.parts for i in part.compiled.ran_eager)
                    blocks = [getattr(layer, "_checkpoint_wrapped_module", layer)
                              for layer in decoder_layers(trainer.model)]
                    result["block_kinds"] = len({type(block.mlp) for block in blocks})
            finally:
                torch._dynamo.reset()
    return result
