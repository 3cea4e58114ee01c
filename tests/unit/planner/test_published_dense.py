"""xorl-plan held against published, measured runs: torchtitan's Llama-3.1 tables on H100.

Sources (pytorch/torchtitan):
- benchmarks/llama3_h100_202412_torchtitan.md tables 1 and 3: 8B, FSDP 8 and FSDP 128, local batch
  2, selective op AC (in xorl: selective_checkpoint every_other_matmul), eager and torch.compile;
- benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, bf16 rows: 70B on 256 GPUs, FSDP 32 x TP 8,
  local batch 16, full AC; 8B on 64 GPUs, FSDP 8 x TP 8, local batch 12, per-op SAC; both with
  sequence parallel and torch.compile, vanilla TP (xorl: tp_overlap false) and async TP (tp_overlap
  true: xorl's ring of NCCL send/recv, torchtitan's of copy-engine transfers over symmetric memory;
  xorl/planner/tp_time.py says what xorl's costs). The 70B memory is the Float8 + compile row of
  the 2024-12 table 4; the other TP rows publish no bf16 memory.
Their GPUs: H100 SXM with 96 GB HBM2e at 2.4 TB/s and a 500 W power limit ("the actual peak TFLOPs
number is between SXM and NVL": 989 and 835, so the midpoint 912), 8 per node with NVLink, 400
Gb/s RDMA per GPU. The flags say exactly that and nothing fitted to these rows: --gpus-per-node 8
--gpu-memory-gb 96 --peak-tflops 912 --hbm-gbps 2400 (NVLink 450 GB/s, 8 NICs of 50 GB/s per node:
the defaults). The runs' own choices in xorl's fields: seq_len 8192, bf16 compute with fp32 master
weights (FSDP2 mixed precision), an unfused cross-entropy on materialised logits (fused_loss
false), vocabulary-parallel loss under TP; train.compile as published (xorl compiles a TP block
around its TP custom ops).

Published memory is torch.cuda.max_memory_reserved: compared with the prediction's ``reserved``.
"""

from __future__ import annotations

import pytest

from xorl.config import Config
from xorl.planner.guide import Options, evaluate
from xorl.planner.step_time import Hardware

LLAMA_31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                   max_position_embeddings=131072)
LLAMA_31_70B = dict(LLAMA_31_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64)
GRAND_TETON = Hardware(gpus_per_node=8, gpu_memory_gb=96.0, peak_tflops=912.0, hbm_gbps=2400.0)
TOKENS_TOLERANCE, MEMORY_TOLERANCE = 0.25, 0.10

# torchtitan's selective AC is op-level SAC keeping every other matmul (its policy's mm_count % 2:
# of q, k, v, o, gate, up, down it recomputes k, o and up): xorl's train.selective_checkpoint:
# every_other_matmul, the same policy (xorl/parallel/data_parallel.py; its cache census equals the
# planner's term, tests/unit/parallel/test_activation_checkpointing.py). With xorl's default (matmuls, every
# output kept) the same rows would hold 2 (hkv + h + I) = 38,912 bytes more per token and layer:
# 104.0 and 90.0 GiB reserved (1.26, 1.34 of published); with torchtitan's policy 83.5 and 69.5 GiB
# (1.01, 1.04), tokens/s 1.13 and 1.15 of published (1.20 and 1.23 without the recomputed matmuls).

SELECTIVE = dict(activation_checkpointing="selective", selective_checkpoint="every_other_matmul")
TP8_SP = dict(tensor_parallel_size=8, sequence_parallel=True, compile=True)

# (name, model, GPUs, train fields, micro_batch_size, published tokens/s per GPU, published GiB)
ROWS = [
    ("llama3.1-8b fsdp8", LLAMA_31_8B, 8, dict(data_parallel_shard_size=8, **SELECTIVE), 2, 5762, 82.4),
    ("llama3.1-8b fsdp128", LLAMA_31_8B, 128, dict(data_parallel_shard_size=128, **SELECTIVE), 2, 5605, 67.0),
    ("llama3.1-70b fsdp32 tp8", LLAMA_31_70B, 256,
     dict(data_parallel_shard_size=32, tp_overlap=False, activation_checkpointing="full", **TP8_SP), 16, 597.3, 71.9),
]
# Throughput only: the compiled FSDP rows of the 2024-12 tables and the rest of the async-TP table.
TOKEN_ROWS = [
    ("llama3.1-8b fsdp8 compile", LLAMA_31_8B, 8, dict(data_parallel_shard_size=8, compile=True, **SELECTIVE),
     2, 6667),
    ("llama3.1-8b fsdp128 compile", LLAMA_31_8B, 128, dict(data_parallel_shard_size=128, compile=True, **SELECTIVE),
     2, 6514),
    ("llama3.1-70b fsdp32 tp8 async", LLAMA_31_70B, 256,
     dict(data_parallel_shard_size=32, tp_overlap=True, activation_checkpointing="full", **TP8_SP), 16, 652.4),
    ("llama3.1-8b fsdp8 tp8", LLAMA_31_8B, 64,
     dict(data_parallel_shard_size=8, tp_overlap=False, **TP8_SP, **SELECTIVE), 12, 4378),
    ("llama3.1-8b fsdp8 tp8 async", LLAMA_31_8B, 64,
     dict(data_parallel_shard_size=8, tp_overlap=True, **TP8_SP, **SELECTIVE), 12, 4809.4),
]
# tp_overlap's published speedup over vanilla TP, (vanilla row, async row): 1.09 and 1.10.
ASYNC_TP = [(ROWS[2], TOKEN_ROWS[2]), (TOKEN_ROWS[3], TOKEN_ROWS[4])]


def _predict(model: dict, gpus: int, train: dict, micro_batch: int, hw: Hardware = GRAND_TETON):
    config = Config.from_dict({
        "model": model, "data": {"seq_len": 8192, "micro_batch_size": micro_batch},
        "train": {"data_parallel_mode": "fsdp2", "dtype": "bfloat16", "gradient_accumulation_steps": 1, **train},
    })
    config.model.fused_loss = False  # torchtitan's loss: cross-entropy of fp32 logits (before and after the field)
    candidate = evaluate(config, Options(gpus, hw))
    tokens_per_gpu = micro_batch * 8192 / train.get("tensor_parallel_size", 1) / candidate.time.total
    return tokens_per_gpu, candidate.memory.reserved / 2**30


@pytest.mark.parametrize("name, model, gpus, train, micro_batch, tokens", [r[:6] for r in ROWS] + TOKEN_ROWS,
                         ids=[r[0] for r in ROWS + TOKEN_ROWS])
def test_tokens_per_second_per_gpu(name, model, gpus, train, micro_batch, tokens):
    predicted, _ = _predict(model, gpus, train, micro_batch)
    assert abs(predicted / tokens - 1) <= TOKENS_TOLERANCE, f"{name}: {predicted:.0f} vs published {tokens}"


# What tp_overlap buys, xorl's ring against torchtitan's async TP. They differ: xorl's runs NCCL
# send/recv on SMs at ~0.58 of NVLink on one stream, forward and backward; torchtitan's copies with
# the copy engines, and its 2024 post (discuss.pytorch.org/t/209487, figure 9) measured it on the
# forward passes only (8B: the step gained what the forward did). Predicted 1.10 (70B) and 1.08
# (8B) against published 1.09 and 1.10, held within 10%: the lumped model before
# xorl/planner/tp_time.py (every collective hidden behind the whole layer's GEMMs) said 1.22, 1.26.
@pytest.mark.parametrize("vanilla, overlapped", ASYNC_TP, ids=[v[0] for v, _ in ASYNC_TP])
def test_tp_overlap_speedup(vanilla, overlapped):
    (name, model, gpus, train, micro_batch, tokens), async_row = vanilla[:6], overlapped
    published = async_row[5] / tokens
    predicted = _predict(*async_row[1:5])[0] / _predict(model, gpus, train, micro_batch)[0]
    assert abs(predicted / published - 1) <= 0.10, f"{name}: tp_overlap x{predicted:.3f} vs published x{published:.3f}"


# The 70B figure is torchtitan's Float8 + torch.compile run (table 4 of the 2024-12 file; the bf16 run's
# memory is published only as an image), with torchtitan's loss_parallel cross-entropy. The planner's
# xorl prediction peaks at the loss's backward: 20.1 GiB of kept block inputs (80 x [t / 8, h]),
# 27.4 GiB of xorl's unfused vocabulary-parallel loss (14 bytes per local logit), 57.2 GiB in all,
# 61.4 reserved (0.85). That moment is right for xorl: held against the allocator of a real TP 2 + SP,
# full-recompute step whose unfused loss dominates it is +3.5 % (tests/multirank/test_planner_activations.py).
# Neither Float8 (torchtitan leaves the output layer in bf16) nor compile (per block; the loss is not
# compiled there) touches it, and full recompute's one-layer working set (after the SP all-gather,
# [t, h] bf16 tensors of 2 GiB) peaks later and lower (32.8 GiB). The gap is two buffers torchtitan's
# run holds and xorl does not allocate (torchtitan at the commit of that table, train.py and
# parallelize_llama.py):
#   - torch's loss_parallel backward holds 16 bytes per local logit (its saved fp32 log-softmax, the
#     nll gradient's zeros_like, exp + that sum, and the product; `del pred` freed the bf16 logits)
#     where xorl's holds 14 (the bf16 logits, the saved fp32 softmax, its gradient and the product):
#     2 t V / tp bytes = 3.9 GiB;
#   - its lm_head (ColwiseParallel from a Shard(1) input) saves the all-gathered [t, h] input for its
#     weight gradient; xorl's column layer keeps its sequence shard and re-gathers in backward:
#     a t h (1 - 1 / tp) = 1.75 GiB.
# Both measured on CPU against the allocator: the same head and loss in torch's loss_parallel recipe
# hold them beyond xorl's (test below). With them the prediction is 0.94 of the published figure.
# xorl would hold less than torchtitan does here, so the row is no miss of the planner's physics;
# but no xorl recipe runs what torchtitan ran, so it stays open.
SEVENTY_B_OPEN = pytest.mark.xfail(strict=True, reason=(
    "predicted 61.4 GiB vs published 71.9 GiB (0.85): torchtitan's loss_parallel backward (16 vs xorl's 14 "
    "bytes per logit, +3.9 GiB) and its lm_head's saved all-gathered input (+1.75 GiB) are buffers xorl does "
    "not allocate (0.94 with them); no xorl recipe matches that run"))


def torchtitan_extra_bytes(t: int, vocab: int, hidden: int, tp: int, a: int = 2) -> float:
    """What torchtitan's lm_head + loss_parallel hold at their peak beyond xorl's (the comment above):
    2 bytes more per local logit and the all-gathered lm_head input less its sequence shard."""
    return 2 * t * vocab / tp + a * t * hidden * (1 - 1 / tp)


def head_and_loss_peak(recipe: str, t: int, hidden: int, vocab: int) -> int:
    """One rank's peak above its start of an lm_head + unfused loss forward and backward, bf16, under
    TP over every rank with SP: ``torch`` is torchtitan's recipe in torch's own API (ColwiseParallel
    from a Shard(1) input, loss_parallel cross-entropy of .float() logits, ``del pred``); ``xorl`` is
    xorl's VocabParallelLMHead and cross_entropy_sum, as its trainer runs them."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from xorl.planner.measure import profiled_peak

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    torch.manual_seed(dist.get_rank())
    x_local = torch.randn(1, t // tp, hidden, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (1, t))
    if recipe == "torch":
        from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

        head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
        parallelize_module(head, mesh, ColwiseParallel(input_layouts=Shard(1), use_local_output=False))

        def step():
            head.weight.grad = x_local.grad = None
            pred = head(DTensor.from_local(x_local, mesh, [Shard(1)], run_check=False))
            with loss_parallel():
                loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
                del pred
                loss.backward()
    else:
        from xorl.nn.cross_entropy import cross_entropy_sum
        from xorl.nn.tp_vocab import VocabParallelLMHead

        head = VocabParallelLMHead(hidden, vocab, False, mesh, True, dtype=torch.bfloat16)
        torch.nn.init.normal_(head.weight.to_local())

        def step():
            head.weight.grad = x_local.grad = None
            logits = head(x_local)  # the trainer's loop holds the logits through the backward
            (cross_entropy_sum(logits, labels) / t).backward()
    return profiled_peak(step)


def test_torchtitans_head_and_loss_hold_more_than_xorls_by_the_stated_buffers(gloo_world):
    # The two buffers of the comment above, measured: the same lm_head + unfused loss in torch's
    # loss_parallel recipe and in xorl's, 2 gloo ranks, bf16, 1024 tokens, vocab 8192 (4 Mi local
    # logits). Measured at this commit: 65.6 MB against 56.4 MB; the difference, 9.2 MB, is the
    # stated 8.65 MB +6 %.
    t, hidden, vocab = 1024, 256, 8192
    torch_peak, xorl_peak = (max(gloo_world(2).run(head_and_loss_peak, recipe, t, hidden, vocab))
                             for recipe in ("torch", "xorl"))
    extra = torchtitan_extra_bytes(t, vocab, hidden, tp=2)
    assert xorl_peak > 12 * t * vocab / 2  # the fp32 buffers are there
    assert abs((torch_peak - xorl_peak) / extra - 1) <= 0.10, (torch_peak, xorl_peak, extra)


def test_the_70b_gap_is_torchtitans_loss_parallel_and_lm_head_input():
    from xorl.planner.memory import ALLOCATOR_OVERHEAD

    name, model, gpus, train, micro_batch, _, gib = ROWS[2]
    _, predicted = _predict(model, gpus, train, micro_batch)
    extra = torchtitan_extra_bytes(micro_batch * 8192, model["vocab_size"], model["hidden_size"],
                                   train["tensor_parallel_size"])
    torchtitan = predicted + extra * (1 + ALLOCATOR_OVERHEAD) / 2**30
    assert abs(predicted / gib - 1) > MEMORY_TOLERANCE  # xorl's own prediction misses the row ...
    assert abs(torchtitan / gib - 1) <= MEMORY_TOLERANCE, (torchtitan, gib)  # ... by torchtitan's two buffers


@pytest.mark.parametrize("name, model, gpus, train, micro_batch, tokens, gib", [
    pytest.param(*ROWS[0], id=ROWS[0][0]),
    pytest.param(*ROWS[1], id=ROWS[1][0]),
    pytest.param(*ROWS[2], marks=SEVENTY_B_OPEN, id=ROWS[2][0]),
])
def test_memory_per_gpu(name, model, gpus, train, micro_batch, tokens, gib):
    _, predicted = _predict(model, gpus, train, micro_batch)
    assert abs(predicted / gib - 1) <= MEMORY_TOLERANCE, f"{name}: {predicted:.1f} GiB vs published {gib}"


@pytest.mark.parametrize("row, gib", [(0, 77.0), (1, 62.0)], ids=["llama3.1-8b fsdp8", "llama3.1-8b fsdp128"])
def test_compiled_memory_per_gpu(row, gib):
    # torchtitan's FSDP + torch.compile rows of the same tables (77.0 and 62.0 GiB: 5.4 and 5.0 below
    # eager). xorl with train.compile keeps one [t, h] less a selective block, down_proj's output,
    # which the compiled backward never reads (tests/multirank/test_planner_activations.py measures it on the
    # allocator): 79.2 and 65.1 GiB (1.03, 1.05), where the eager prediction was 1.08 and 1.12 of them.
    name, model, gpus, train, micro_batch, _, _ = ROWS[row]
    _, eager = _predict(model, gpus, train, micro_batch)
    _, predicted = _predict(model, gpus, dict(train, compile=True), micro_batch)
    assert predicted < eager
    assert abs(predicted / gib - 1) <= MEMORY_TOLERANCE, f"{name}: {predicted:.1f} GiB vs published {gib}"


# FP8 rows: torchtitan's Float8 (torchao Float8Linear, tensorwise unless named) with torch.compile,
# against xorl's train.fp8 with train.compile (the FP8 GEMMs as custom ops, the casts xorl's fused
# Triton kernels: xorl/planner/fp8_time.py):
# - 2024-12 tables 1 and 3, "FSDP + torch.compile + Float8": 8,532 and 8,380 tok/s, 76.8 and 61.8 GiB
#   (that torchtitan's llama3_8b.toml left enable_fsdp_float8_all_gather false);
# - benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (Trainy on WhiteFiber, June 2025): 8B,
#   H200 (989 TFLOP/s bf16, 4.8 TB/s HBM3e, 141 GB), 4 and 8 nodes of 8 (FSDP 32 and 64), local
#   batch 2, compile, Float8 with enable_fsdp_float8_all_gather (xorl: fp8_all_gather), selective op
#   AC (that commit's llama3_8b.toml): 10,938 and 10,753 tok/s. Its memory (47.96 and 46.97 GiB) is
#   not held: by then torchtitan compiled its loss with the model (torchtitan/components/loss.py at
#   e7c0cae; 2024-12's train.py had it commented out), which keeps a few bytes per logit where an
#   eager fp32 cross-entropy keeps 14 (xorl's unfused loss: 67.9 and 66.1 GiB, 1.42) and xorl's fused
#   loss none (40.9 and 39.1 GiB, 0.85): no xorl recipe is that loss;
# - the async-TP table's float8 tensorwise rows (70B: 809.8 vanilla, 942.4 async TP; 8B on 64 GPUs:
#   5,078.1 and 5,570.1). Under TP xorl casts each column group's input once on its sequence shard and
#   gathers float8 (xorl/nn/tp_fp8.py), as torchao's Float8ColwiseParallel does; before it cast the
#   gathered input once per linear and these rows were predicted at 0.67-0.84. Its float8 rowwise rows
#   (599.6 / 624.8; 3,708.5 / 3,914.9) are not held: the table itself notes torchtitan's vanilla-TP
#   rowwise baseline as a known slow path (its issue 1207: torchao's float8 TP "currently assumes
#   tensorwise scaling"); xorl's rowwise is predicted at 1.16-1.35 of them.
H200 = Hardware(gpus_per_node=8, gpu_memory_gb=141.0, peak_tflops=989.0, hbm_gbps=4800.0)
FP8_TOKEN_ROWS = [
    ("llama3.1-8b fsdp8 compile float8", LLAMA_31_8B, 8,
     dict(data_parallel_shard_size=8, compile=True, fp8="tensorwise", **SELECTIVE), 2, 8532, GRAND_TETON),
    ("llama3.1-8b fsdp128 compile float8", LLAMA_31_8B, 128,
     dict(data_parallel_shard_size=128, compile=True, fp8="tensorwise", **SELECTIVE), 2, 8380, GRAND_TETON),
    ("llama3.1-8b h200 fsdp32 float8", LLAMA_31_8B, 32,
     dict(data_parallel_shard_size=32, compile=True, fp8="tensorwise", fp8_all_gather=True, **SELECTIVE), 2, 10938,
     H200),
    ("llama3.1-8b h200 fsdp64 float8", LLAMA_31_8B, 64,
     dict(data_parallel_shard_size=64, compile=True, fp8="tensorwise", fp8_all_gather=True, **SELECTIVE), 2, 10753,
     H200),
    ("llama3.1-70b fsdp32 tp8 float8", LLAMA_31_70B, 256,
     dict(data_parallel_shard_size=32, tp_overlap=False, activation_checkpointing="full", fp8="tensorwise", **TP8_SP),
     16, 809.8, GRAND_TETON),
    ("llama3.1-70b fsdp32 tp8 async float8", LLAMA_31_70B, 256,
     dict(data_parallel_shard_size=32, tp_overlap=True, activation_checkpointing="full", fp8="tensorwise", **TP8_SP),
     16, 942.4, GRAND_TETON),
    ("llama3.1-8b fsdp8 tp8 float8", LLAMA_31_8B, 64,
     dict(data_parallel_shard_size=8, tp_overlap=False, fp8="tensorwise", **TP8_SP, **SELECTIVE), 12, 5078.1,
     GRAND_TETON),
    ("llama3.1-8b fsdp8 tp8 async float8", LLAMA_31_8B, 64,
     dict(data_parallel_shard_size=8, tp_overlap=True, fp8="tensorwise", **TP8_SP, **SELECTIVE), 12, 5570.1,
     GRAND_TETON),
]


@pytest.mark.parametrize("name, model, gpus, train, micro_batch, tokens, hw", FP8_TOKEN_ROWS,
                         ids=[r[0] for r in FP8_TOKEN_ROWS])
def test_fp8_tokens_per_second_per_gpu(name, model, gpus, train, micro_batch, tokens, hw):
    predicted, _ = _predict(model, gpus, train, micro_batch, hw)
    assert abs(predicted / tokens - 1) <= TOKENS_TOLERANCE, f"{name}: {predicted:.0f} vs published {tokens}"


@pytest.mark.parametrize("row, gib", [(0, 76.8), (1, 61.8)], ids=[r[0] for r in FP8_TOKEN_ROWS[:2]])
def test_fp8_memory_per_gpu(row, gib):
    # FP8 keeps what bf16 keeps (the GEMMs re-cast their saved high-precision inputs), so the
    # compiled rows' memory: 79.2 and 65.1 GiB (1.03, 1.05).
    name, model, gpus, train, micro_batch, _, hw = FP8_TOKEN_ROWS[row]
    _, predicted = _predict(model, gpus, train, micro_batch, hw)
    assert abs(predicted / gib - 1) <= MEMORY_TOLERANCE, f"{name}: {predicted:.1f} GiB vs published {gib}"
