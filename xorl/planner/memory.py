"""Memory per GPU of one layout: exact where the sharded model decides it, a stated estimate elsewhere.

EXACT (equal, byte for byte, to what the trainer's sharded model holds on a rank; checked by
tests/test_plan_memory.py, which builds the real parallel model of every example on the meta
device under torch's fake process group):

  params     the local shards of the fp32 master weights. The parameter shapes come from the model
             xorl builds (meta device, MoE blocks swapped for xorl.nn.MoE as parallelize does); the
             plans then split them:
             TP   q/k/v/gate/up (and column biases) on dim 0, o/down on dim 1, over
                  tensor_parallel_size (xorl/plans/tensor_parallel.py); MoE blocks stay whole;
             EP   stacked experts on dim 0 over expert_parallel_size;
             FSDP2 dim 0 of the resulting local tensor chunked like torch.chunk over the sharding
                  group (dp_shard x ring x ulysses; experts under EP: ep_fsdp), so sharding rank r
                  holds min(c, n - r*c) rows, c = ceil(n / group): rank 0 holds the most;
             PP   the layers of the stages this pipeline rank runs (xorl/plans/pipeline_parallel.py), the
                  embedding on stage 0, final norm and lm_head on the last stage.
  LoRA       (model.lora) the adapters are parameters like any other (split by TP to match their
             base: B of a column layer on dim 0, A of a row layer on dim 1); grads and optimizer count
             only them, the frozen base holds weights alone, in the compute dtype (bf16 under
             fsdp2 + dtype bfloat16 on GPU: the trainer stores it so, xorl/nn/lora.py cast_frozen_).
  grads      FSDP2's sharded gradient: the sharded parameter's shape in the master dtype
             (reduce_dtype fp32); ddp / none: full fp32 gradients of the local (TP/EP) parameters.
  optimizer  AdamW's exp_avg and exp_avg_sq: two fp32 tensors shaped like each local parameter
             (its `step` counter lives on the host).
  --precision fp16 counts 2 / 2 / 4 bytes per parameter instead of 4 / 4 / 8 (half-precision
  weights and gradients, 4 optimizer bytes: the assumptions of published tables, not what
  xorl-train runs).

ESTIMATED (a stated model; scripts/plan_calibrate.py compares it with
torch.cuda.max_memory_allocated on one GPU). t = micro_batch_size x seq_len / cp tokens per rank and
microbatch; a = 2 bytes (bf16 compute: fsdp2 with dtype bfloat16) or 4; s = tp under sequence
parallel, else 1; h hidden, hq / hkv query / KV width (heads x head_dim), I intermediate size.

  activations, bytes per token of one decoder layer with no recompute, as xorl_kernels' fused
  ops save them (rms_norm / add_rms_norm, rope, swiglu custom ops; counted on a real layer with
  torch's saved_tensors_hooks, equal to the byte):
    2 norms        (4 a h + 8) / s            the layer input (rms_norm keeps its input), the residual
                                              sum (add_rms_norm keeps it), both norms' outputs (the
                                              next linears keep them) and two 1/rms
    attention      (a (hq + 2hkv) + a hq + 4 heads [+ a (hq + hkv) + 4 (heads + kv heads) q/k norm]) / tp
                                              q, k (after RoPE), v for the attention backward; its
                                              output and log-sum-exp; q/k norm keeps the projections
                                              and 1/rms per head. RoPE keeps only cos / sin, shared
                                              by all layers (2 a head_dim per token)
    dense MLP      3 a I / tp                 gate and up (SwiGLU's inputs), their product (down_proj's)
    MoE MLP        (8E + 24k + 12 + 2 a k h + 3 a k I_moe + 3 a I_shared [+ a h + a]) / tp
                   [+ a h gathered under TP without SP]
                                              fp32 router logits and probabilities, the top-k ids and
                                              weights, the k routed copies of the token and the expert
                                              outputs, the experts' gate_up and SwiGLU outputs
                                              (balanced routing); a shared expert's, and its gate's
  backward working set (every policy): the gradients one layer's backward holds beyond what it
    frees, 2 a h / s + 2 a I / tp (MoE: 2 a h / s + a k h + 2 a (k I_moe + I_shared)), see
    backward_bytes_per_token; with recompute also that layer's recomputed activations (selective:
    the no-recompute bytes less the saved ones).
  full recompute (activation_checkpointing: full / true) keeps only a checkpointed layer's input,
  a h / s (every n-th layer with activation_checkpointing_every_n_layers: n; the others keep all),
  and the backward adds one layer's no-recompute activations while it recomputes; selective keeps
  the matmul, attention and collective outputs and the block's input: (a (2hq + 2hkv) + 4 heads) / tp
  + 2 a h / s + (2 a I / tp + a h / s dense | (a E + a k h + 2 a k I_moe [+ 2 a I_shared + a h + a]) / tp MoE:
  the grouped GEMMs' outputs; a saved-cache census equals it, tests/test_activation_checkpointing.py);
  with selective_checkpoint: every_other_matmul less the outputs of the 2nd, 4th, ... dense matmul
  of the block (block_matmuls: k, o and up of a Llama layer, a (hkv / tp + h / s + I / tp)), which
  its recompute runs again.
  Microbatches in flight on pipeline rank r of p (m microbatches, v stages per rank): 1 without
  PP; 1F1B min(m, p - r); GPipe m; interleaved (v-1) p + 2 (p-1-r) + 1 chunks of layers/v
  layers (torch's warm-up count); ZBV min(m, p) (as 1F1B, per the zero-bubble-V paper).
  Loss (last stage, one microbatch), vocab = V / tp when TP splits the vocabulary (lm_head is
  vocabulary-parallel, xorl/nn/cross_entropy.py): t x vocab x (a + 12): the logits, the fp32
  log-softmax kept for backward and two fp32 gradient temporaries; without PP the trainer's loop
  holds the logits (a t vocab) in the model's output through the backward, and with m > 1 also
  while the next microbatch's forward runs. Under PP the last stage computes the loss in its
  forward too (fused or not) and passes on only the loss sum (xorl/plans/pipeline_parallel.py),
  so no logits outlive the loss there: t x vocab x 12 (a + 12 for the vocabulary-parallel loss on
  bf16 logits, whose forward makes three fp32 copies beside them). With model.fused_loss (xorl_kernels/fused_linear_ce,
  default on) no logits: one chunk's [chunk, vocab] x a (chunk = default_chunk_size there,
  min(t, max(128, next_pow2(ceil(t / ceil(vocab / h)))))), d_hidden a t h and d_weight
  a vocab h, both made in the forward; d_weight is lm_head's gradient, already in the FSDP root
  group's buffers below where FSDP holds them. (The CPU reference adds one fp32 [chunk, vocab]
  temporary the Triton kernels do not allocate.)

  other: FSDP2's unsharded blocks in flight: the largest decoder layer (TP/EP-local size) x (2 p_u
  + g_u + 4 [fp32 reduce-scatter input, with bf16 gradients] + 4 [the previous layer's reduce-
  scatter]) with p_u = g_u = a, i.e. the running and the prefetched layer, its gradient and the
  reduce-scatters; the root group (embedding, final norm, lm_head) stays gathered through the
  forward and the backward (its module wraps both) and holds lm_head's gradient from the start of
  backward: x (p_u + g_u); zero-bubble schedules keep the whole stage unsharded with fp32
  gradients: x (p_u + 4); fsdp_reshard_after_forward: never keeps every layer's gathered weights
  to its backward: the stage x p_u plus one layer's gradient buffers. Communication buffers: TP 2
  a t h, Ulysses 2 a t (hq + 2 hkv) / tp, ring 2 a t 2hkv / tp + 4 t hq / tp (fp32 merge), EP 2 a
  t k h / tp (under TP the MoE block runs on t / tp tokens), PP 2 a t h per microbatch in flight,
  ddp 128 MiB buckets; 256 MiB of kernel workspace.
  The optimizer step's foreach temporaries (4 bytes per local parameter) come when activations are
  freed.

  The peak is one moment (step_peak): the largest of the loss's backward (kept activations, the
  loss's buffers, the gathered blocks), the first layer's backward (kept activations, its recompute
  and gradient working set, the gathered blocks and one layer's gradient buffers) and the end of the
  step (gradients and the optimizer's temporaries), plus what is held throughout (workspace,
  communication buffers). Buckets: activations at the peak; other, the buffers at the peak or
  what the peak holds beyond activations and gradients, whichever is larger. Held to the CPU
  allocator by tests/test_plan_activations.py; the whole grid in bench/results/plan-cpu-activations.json.
  The CPU references of the element-wise ops allocate fp32 temporaries the Triton kernels do not
  (SwiGLU's backward two [t, I] more, where a layer's backward peaks), which this GPU model leaves out.
  Reserved (what torch.cuda.max_memory_reserved reports): the total plus ALLOCATOR_OVERHEAD of the
  activations and other buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from xorl.distributed.parallel_config import PIPELINE_SCHEDULES, ParallelConfig
from xorl.nn.lora import is_adapter_name
from xorl.plans.pipeline_parallel import layer_ranges, num_stages, stage_indices

# Zero-bubble schedules: the stage stays gathered (xorl/plans/pipeline_parallel.py).
SPLIT_BACKWARD_SCHEDULES = tuple(name for name, info in PIPELINE_SCHEDULES.items() if info.split_backward)
# The vocabulary-parallel embedding and lm_head (xorl/plans/tensor_parallel.py), when TP divides the vocabulary.
VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")

# Parameter names inside a decoder layer that the TP plan shards, and the dim (xorl/plans/tensor_parallel.py).
TP_SHARD_DIM = {
    **{f"self_attn.{x}_proj.{kind}": 0 for x in ("q", "k", "v", "qkv") for kind in ("weight", "bias")},
    "self_attn.o_proj.weight": 1,
    "self_attn.sinks": 0,  # gpt-oss: one logit per query head, split with the heads
    "self_attn.q_b_proj.weight": 0, "self_attn.kv_b_proj.weight": 0,  # latent attention's per-head up-projections
    **{f"mlp.{x}_proj.{kind}": 0 for x in ("gate", "up", "gate_up") for kind in ("weight", "bias")},
    "mlp.down_proj.weight": 1,
    # LoRA adapters split to match their base (xorl/nn/tensor_parallel.py): B with a column base, A with a row base.
    **{f"self_attn.{x}_proj.lora_B": 0 for x in ("q", "k", "v")},
    **{f"mlp.{x}_proj.lora_B": 0 for x in ("gate", "up")},
    "self_attn.o_proj.lora_A": 1,
    "mlp.down_proj.lora_A": 1,
}
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                 "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias",  # gpt-oss: per-expert biases
                 # LoRA's per-expert adapters, [E, ...] and split like the experts (xorl/nn/lora.py)
                 *(f"mlp.experts.lora_{w}.lora_{x}" for w in ("gate_up_proj", "down_proj") for x in "AB"))
PRECISIONS = {"fp32-master": (4, 4, 8), "fp16": (2, 2, 4)}  # bytes per parameter: weights, grads, optimizer
WORKSPACE_BYTES = 256 * 2**20
# ASSUMPTION until scripts/plan_calibrate.py measures max_memory_reserved against max_memory_allocated
# on a GPU: the caching allocator's block rounding and fragmentation keep about 8% more than is
# allocated of the memory that is freed and re-allocated during the step (parameters, gradients and
# optimizer state are allocated once and pack without waste).
ALLOCATOR_OVERHEAD = 0.08
DDP_BUCKET_BYTES = 2 * 64 * 2**20


Params = tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) pairs


@dataclass(frozen=True)
class ModelShapes:
    """Parameter shapes of the model xorl builds: per decoder layer, the embedding, the head.

    Layers with the same parameters share a kind (dense / MoE), so sums run once per kind.
    """

    kinds: tuple[Params, ...]  # distinct decoder-layer parameter sets
    layer_kind: tuple[int, ...]  # kind of each decoder layer
    first: Params  # stage 0: model.embed_tokens.*
    last: Params  # last stage: model.norm.*, lm_head.*
    num_params: int
    active_params: int  # per token: one top-k share of the experts
    # decoder-layer parameters that are xorl.nn.linear.Linear weights: what train.fp8 computes in FP8
    # and, with fp8_all_gather, what FSDP gathers in float8 (step_time)
    fp8_linear_weights: frozenset = frozenset()

    @property
    def layers(self) -> tuple[Params, ...]:
        return tuple(self.kinds[k] for k in self.layer_kind)

    def is_moe_kind(self, kind: int) -> bool:
        return any(name in EXPERT_PARAMS for name, _ in self.kinds[kind])


@functools.lru_cache(maxsize=8)
def _shapes(model_fields: tuple) -> ModelShapes:
    import torch

    from xorl.config import ModelConfig
    from xorl.models.registry import build_model
    from xorl.models.spec import ModelSpec

    model_config = ModelConfig(**{k: dict(v[1]) if isinstance(v, tuple) and v[:1] == ("__dict__",) else v
                                  for k, v in model_fields})
    with torch.device("meta"):
        model = build_model(model_config)
    spec = ModelSpec.from_config(model_config)
    layers: list[list] = [[] for _ in range(spec.num_hidden_layers)]
    first, last = [], []
    total = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            layers[int(index)].append((rest, tuple(p.shape)))
            experts += p.numel() if rest in EXPERT_PARAMS else 0
        else:
            (first if name.startswith("model.embed_tokens.") else last).append((name, tuple(p.shape)))
    from xorl.nn.linear import Linear

    linear_weights = frozenset(f"{name.split('.', 3)[3]}.weight" for name, module in model.named_modules()
                               if isinstance(module, Linear) and name.startswith("model.layers."))
    top_k_share = spec.num_experts_per_tok / spec.num_experts if spec.is_moe else 1.0
    kinds = list(dict.fromkeys(tuple(x) for x in layers))
    return ModelShapes(tuple(kinds), tuple(kinds.index(tuple(x)) for x in layers), tuple(first), tuple(last),
                       total, round(total - experts * (1 - top_k_share)), linear_weights)


def model_shapes(model_config) -> ModelShapes:
    def hashable(v):  # lru_cache keys: lists as tuples, dicts (rope_scaling, lora) as tagged item tuples
        if isinstance(v, dict):
            return ("__dict__", tuple(sorted((k, hashable(x)) for k, x in v.items())))
        return tuple(v) if isinstance(v, list) else v

    return _shapes(tuple(sorted((k, hashable(v)) for k, v in dataclasses.asdict(model_config).items())))


def local_numel(name: str, shape: tuple[int, ...], p: ParallelConfig, fsdp: bool, shard_rank: int) -> int:
    """Elements of this parameter on a rank at FSDP sharding index ``shard_rank`` (see the docstring)."""
    dims = list(shape)
    tp_dim = TP_SHARD_DIM.get(name)
    if tp_dim is not None and p.tp > 1:
        dims[tp_dim] //= p.tp
    if name in VOCAB_PARAMS and p.tp > 1 and dims[0] % p.tp == 0:
        dims[0] //= p.tp
    group, rank = p.dp_shard_cp, shard_rank
    if name in EXPERT_PARAMS and (p.ep > 1 or p.tp > 1):
        dims[0] //= p.ep
        # The EP mesh is (ep_fsdp, ep) over dp_shard x cp x tp (TP rank 0 of this sharding index). Under
        # TP without EP too, the experts (whole on every TP rank) are FSDP-sharded over ep_fsdp, the TP
        # ranks included (xorl/plans/data_parallel.py experts_have_own_mesh).
        group, rank = p.ep_fsdp, shard_rank * p.tp // p.ep
    if fsdp and group > 1:
        chunk = -(-dims[0] // group)
        dims[0] = max(0, min(chunk, dims[0] - rank * chunk))
    return math.prod(dims)


def kind_numel(kind: Params, p: ParallelConfig) -> int:
    """Elements of one decoder layer after TP / EP, before FSDP: what FSDP2 all-gathers."""
    return sum(local_numel(n, s, p, False, 0) for n, s in kind)


@dataclass(frozen=True)
class RankParams:
    """Parameter counts of one pipeline rank at one sharding index."""

    local: int  # elements held (sharded)
    trainable: int  # of those, the ones with gradients and optimizer state (LoRA: the adapters alone)
    layers: tuple[int, ...]  # the decoder layers it runs
    stage_layers: tuple[int, ...]  # layers per stage it runs
    largest_layer_unsharded: int  # TP/EP-local elements of its largest layer (what FSDP all-gathers)
    root_unsharded: int  # embedding / final norm / lm_head elements (TP-local: vocabulary-parallel)
    stage_unsharded: int  # every TP/EP-local element it runs
    has_first: bool
    has_last: bool


def rank_params(shapes: ModelShapes, p: ParallelConfig, schedule: str, virtual: int, pp_rank: int,
                fsdp: bool, shard_rank: int = 0) -> RankParams:
    if p.pp > 1:
        total = num_stages(p.pp, virtual, schedule)
        ranges = layer_ranges(len(shapes.layers), total)
        ids = stage_indices(pp_rank, p.pp, virtual, schedule)
        stages = [range(*ranges[s]) for s in ids]
        has_first, has_last = 0 in ids, total - 1 in ids
    else:
        stages, has_first, has_last = [range(len(shapes.layers))], True, True
    layers = [i for stage in stages for i in stage]
    lora = any(is_adapter_name(n) for kind in shapes.kinds for n, _ in kind)

    def trains(name: str) -> bool:  # under LoRA only the adapters (the base is frozen: xorl/nn/lora.py)
        return not lora or is_adapter_name(name)

    per_kind = [(sum(local_numel(n, s, p, fsdp, shard_rank) for n, s in kind), kind_numel(kind, p),
                 sum(local_numel(n, s, p, fsdp, shard_rank) for n, s in kind if trains(n))) for kind in shapes.kinds]
    local = unsharded = largest = trainable = 0
    for i in layers:
        held, full, train = per_kind[shapes.layer_kind[i]]
        local += held
        unsharded += full
        trainable += train
        largest = max(largest, full)
    root = [*(shapes.first if has_first else ()), *(shapes.last if has_last else ())]
    root_local = sum(local_numel(n, s, p, fsdp, shard_rank) for n, s in root)
    root_full = sum(local_numel(n, s, p, False, 0) for n, s in root)  # TP-local: vocab-parallel when TP divides V
    trainable += sum(local_numel(n, s, p, fsdp, shard_rank) for n, s in root if trains(n))
    return RankParams(local + root_local, trainable, tuple(layers), tuple(len(s) for s in stages), largest, root_full,
                      unsharded + root_full, has_first, has_last)


@dataclass
class Memory:
    params: int
    grads: int
    optimizer: int
    activations: int | None = None
    other: int | None = None
    pp_rank: int = 0  # the pipeline rank these bytes are for (the peak one)
    # The modelled peak moment of a step above parameters + optimizer state (gradients, activations,
    # buffers at that moment). The buckets' total can exceed params + optimizer + step_peak by at most
    # the gradients, when the peak comes before the backward has created them.
    step_peak: int | None = None

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + (self.activations or 0) + (self.other or 0)

    @property
    def reserved(self) -> int:
        """What the caching allocator holds at the peak (torch.cuda.max_memory_reserved): the total plus
        ALLOCATOR_OVERHEAD of the bytes that come and go within a step (activations, other)."""
        return self.total + int(ALLOCATOR_OVERHEAD * ((self.activations or 0) + (self.other or 0)))

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other, "total": self.total,
                "reserved": self.reserved, "step_peak": self.step_peak}


def state_bytes(numel: int, precision: str) -> tuple[int, int, int]:
    weights, grads, optimizer = PRECISIONS[precision]
    return numel * weights, numel * grads, numel * optimizer


def even_split_memory(num_params: int, p: ParallelConfig, precision: str) -> Memory:
    """A bare parameter count: parameters split evenly over TP x PP (x the FSDP shards)."""
    shards = p.tp * p.pp * (p.dp_shard_cp if p.data_parallel_mode == "fsdp2" else 1)
    return Memory(*state_bytes(-(-num_params // shards), precision))


def inflight_microbatches(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """Microbatches whose activations a pipeline rank holds at once, in units of its whole layer set."""
    if p == 1:
        return 1
    if schedule == "GPipe":
        return m
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return min(m * v, (v - 1) * p + 2 * (p - 1 - rank) + 1) / v
    if schedule == "ZBVZeroBubble":
        return min(m, p)
    return min(m, p - rank)


def vocab_split(vocab_size: int, tp: int) -> int:
    """The TP ranks lm_head's vocabulary (and so the logits and the loss) is split over."""
    return tp if tp > 1 and vocab_size % tp == 0 else 1


def fused_loss(model_config) -> bool:
    """model.fused_loss: the chunked linear cross-entropy that never holds [tokens, vocab] fp32 logits.
    Read with a default so the planner runs on configs from before the field existed."""
    return bool(getattr(model_config, "fused_loss", False))


def loss_bytes(spec, model_config, a: int, t: int, tp: int, loop: bool, m: int, head_grad_counted: bool
               ) -> tuple[float, float]:
    """The loss's buffers on the last stage (see the module docstring): (at the loss, held through the
    layers' backward). ``loop``: the trainer's own microbatch loop (no PP), whose model output keeps
    the unfused logits until the next microbatch's forward has returned; a pipeline stage's output is
    the loss sum alone. ``head_grad_counted``: the
    lm_head's gradient is already in the FSDP root group's buffers."""
    vocab = spec.vocab_size // vocab_split(spec.vocab_size, tp)
    h = spec.hidden_size
    if fused_loss(model_config):
        from xorl_kernels.fused_linear_ce.op import default_chunk_size

        # The kernel's own chunking; under sequence parallelism it sees the gathered t tokens.
        chunk = default_chunk_size(t, vocab, h)
        return chunk * vocab * a + a * t * h + (0 if head_grad_counted else a * vocab * h), 0
    # 12 bytes per logit: the fp32 log-softmax (softmax under TP) kept for the backward and two fp32
    # gradient temporaries; the logits themselves (a) while something holds them: the trainer's loop
    # (the model's output, through the backward). A pipeline stage returns only the loss sum, so its
    # logits are freed after the forward: 12, except where the forward itself holds more, the
    # vocabulary-parallel loss's on bf16 logits (their fp32 copy, the shifted logits and their
    # exponentials beside them: a + 12). Held to the CPU allocator under PP (tests/test_pipeline_loss_memory.py:
    # t V (a + 12) there was +31 %).
    logits = a * t * vocab if loop else 0
    if not loop:
        return t * vocab * (a + 12 if vocab_split(spec.vocab_size, tp) > 1 and a == 2 else 12), 0
    return t * vocab * (a + 12) + (logits if m > 1 else 0), logits


def checkpointing(train) -> tuple[str, int]:
    """(none | full | selective, every n-th layer) from train.activation_checkpointing (bool or mode)."""
    setting = train.activation_checkpointing
    mode = {True: "full", False: "none"}.get(setting, setting) if isinstance(setting, bool) else setting
    return mode, getattr(train, "activation_checkpointing_every_n_layers", 1)


def every_other_matmul(train) -> bool:
    """train.selective_checkpoint: every_other_matmul (read with a default for older configs)."""
    return checkpointing(train)[0] == "selective" and \
        getattr(train, "selective_checkpoint", "matmuls") == "every_other_matmul"


def block_matmuls(spec, moe_layer: bool, tp: int, sp: bool) -> list[tuple[float, float, float, float]]:
    """The dense matmuls (aten mm / addmm) of one decoder block in the order it runs them, as
    selective_checkpoint: every_other_matmul counts them (xorl/plans/data_parallel.py): per matmul
    (elements its output keeps per token, tokens per token, n, k): the output on this TP rank, in
    the units of the selective terms below (a row layer's output per token of the sequence shard
    under SP: h / s); the GEMM is [t x tokens, k] @ [k, n]. The experts' grouped GEMMs are not
    dense matmuls (always kept); an MoE block runs on this TP rank's t / tp tokens."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    s = tp if sp else 1
    if spec.is_mla:  # xorl/models/mla.py: q (or q_a, q_b), kv_a, kv_b, o
        d_qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        q = ([(heads * d_qk / tp, 1, heads * d_qk / tp, h)] if spec.q_lora_rank is None
             else [(spec.q_lora_rank, 1, spec.q_lora_rank, h), (heads * d_qk / tp, 1, heads * d_qk / tp,
                                                                spec.q_lora_rank)])
        kv_a = spec.kv_lora_rank + spec.qk_rope_head_dim
        kv_b = heads * (spec.qk_nope_head_dim + spec.v_head_dim) / tp
        out = q + [(kv_a, 1, kv_a, h), (kv_b, 1, kv_b, spec.kv_lora_rank), (h / s, 1, h, heads * spec.v_head_dim / tp)]
    else:
        hq, hkv = heads * spec.head_dim / tp, spec.num_key_value_heads * spec.head_dim / tp
        widths = [hq + 2 * hkv] if getattr(spec, "merge_qkv", False) else [hq, hkv, hkv]
        out = [(w, 1, w, h) for w in widths] + [(h / s, 1, h, hq)]
    if moe_layer:  # the router, then a shared expert's gate, up, down and its sigmoid gate
        shared, e = spec.shared_expert_intermediate_size, spec.num_experts
        out.append((e / tp, 1 / tp, e, h))
        if shared:
            out += [(shared / tp, 1 / tp, shared, h)] * 2 + [(h / tp, 1 / tp, h, shared)]
            if spec.family.shared_expert_gate:
                out.append((1 / tp, 1 / tp, 1, h))
        return out
    inter = spec.intermediate_size / tp
    gate_up = [2 * inter] if getattr(spec, "merge_gate_up", False) else [inter, inter]
    return out + [(w, 1, w, h) for w in gate_up] + [(h / s, 1, h, inter)]


def recomputed_matmuls(spec, moe_layer: bool, tp: int, sp: bool) -> list[tuple[float, float, float, float]]:
    """The matmuls every_other_matmul recomputes: the 2nd, 4th, ... of block_matmuls."""
    return block_matmuls(spec, moe_layer, tp, sp)[1::2]


def reshards_after_forward(train, pp: int) -> bool:
    """FSDP2's reshard_after_forward as xorl/parallelize.py sets it."""
    setting = getattr(train, "fsdp_reshard_after_forward", "default")
    if setting == "default":
        return not (pp > 1 and train.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES)
    return setting == "always"


def selective_bytes_per_token(spec, moe_layer: bool, a: int, tp: int, sp: bool, every_other: bool = False
                              ) -> float:
    """One decoder layer under selective checkpointing: matmul / attention / collective outputs;
    ``every_other`` (selective_checkpoint: every_other_matmul): less the recomputed matmuls' outputs."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    hq, hkv = heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    # q, k, v, the attention's output and log-sum-exp, o_proj's output, and the block's input, which
    # the checkpoint keeps (the previous block's residual sum, recomputed there)
    kept = (a * (2 * hq + 2 * hkv) + 4 * heads) / tp + 2 * a * h / (tp if sp else 1)
    if moe_layer:
        kept += selective_moe_bytes_per_token(spec, a, tp)
    else:  # gate, up and down_proj's outputs
        kept += 2 * a * spec.intermediate_size / tp + a * h / (tp if sp else 1)
    if every_other:
        kept -= a * sum(elements for elements, *_ in recomputed_matmuls(spec, moe_layer, tp, sp))
    return kept


def selective_moe_bytes_per_token(spec, a: int, tp: int) -> float:
    """The MoE block's share of selective_bytes_per_token (matmuls): on this TP rank's token shard, the
    router's, experts' and shared expert's matmul outputs (the routed experts' output is the grouped
    GEMM's, a k h: no dense down_proj output)."""
    h, k, shared = spec.hidden_size, spec.num_experts_per_tok, spec.shared_expert_intermediate_size
    return (a * spec.num_experts + a * k * h + 2 * a * k * spec.moe_intermediate_size
            + (2 * a * shared + a * h + a if shared else 0)) / tp


def backward_bytes_per_token(spec, moe_layer: bool, a: int, tp: int, sp: bool) -> float:
    """What a layer's backward holds at once beyond its saved tensors: the gradient of its output
    and of its input (2 a h / s) and, at the SwiGLU backward, the gradients of the product, of gate
    and of up (3 a I / tp) less down_proj's saved input that its backward has freed by then: 2 a I / tp
    (MoE: of the k routed copies, a k h + 2 a k I_moe + 2 a I_shared)."""
    h, s = spec.hidden_size, tp if sp else 1
    if moe_layer:
        k = spec.num_experts_per_tok
        return 2 * a * h / s + (a * k * h + 2 * a * (k * spec.moe_intermediate_size
                                                     + spec.shared_expert_intermediate_size)) / tp
    return 2 * a * h / s + 2 * a * spec.intermediate_size / tp


def activation_bytes_per_token(spec, moe_layer: bool, a: int, tp: int, sp: bool) -> float:
    """One decoder layer, no recompute (the docstring's table): the tensors its backward keeps, as the
    fused ops of xorl_kernels save them (counted on a real layer by saved_tensors_hooks: exact)."""
    h, d, heads = spec.hidden_size, spec.head_dim, spec.num_attention_heads
    kv_heads = spec.num_key_value_heads
    hq, hkv = heads * d, kv_heads * d
    s = tp if sp else 1
    # rms_norm keeps its input and 1/rms; add_rms_norm its sum (the new residual) and 1/rms; the
    # next linear keeps each norm's output.
    norms = (4 * a * h + 8) / s
    # q, k after RoPE, v; the output and log-sum-exp. A sliding-window layer (gpt-oss, Mistral) keeps
    # the same (the kernel recomputes its band in backward from them; tests/test_plan_activations.py):
    # the window shortens its FLOPs (step_time.py), not its activations.
    attn = a * (hq + 2 * hkv) + a * hq + 4 * heads
    if spec.qk_norm == "head":  # the q / k projections (the norms' inputs) and 1/rms per head
        attn += a * (hq + hkv) + 4 * (heads + kv_heads)
    elif spec.qk_norm == "width":
        attn += a * (hq + hkv) + 8
    mlp = moe_block_bytes_per_token(spec, a, tp, sp) if moe_layer else 3 * a * spec.intermediate_size / tp
    return norms + attn / tp + mlp  # dense: SwiGLU keeps gate and up, down_proj its product


def moe_block_bytes_per_token(spec, a: int, tp: int, sp: bool) -> float:
    """The MoE block's share of activation_bytes_per_token (no recompute)."""
    h, k, shared = spec.hidden_size, spec.num_experts_per_tok, spec.shared_expert_intermediate_size
    # Under TP the block runs on this rank's token shard (xorl/plans/tensor_parallel.py); without
    # sequence parallelism it then gathers its output over TP (a h). Router: fp32 logits and
    # probabilities (8E), the top-k ids twice (int64) and weights with their normalisation
    # (24k + 12); experts: the k routed copies, their gate_up and SwiGLU outputs, and the expert
    # outputs the combine weighs (2akh + 3akI); a shared expert's gate_up and SwiGLU outputs (3aI),
    # and with its sigmoid gate the expert's output and the gate (a h + a).
    routed = 8 * spec.num_experts + 24 * k + 12 + 2 * a * k * h + 3 * a * k * spec.moe_intermediate_size
    if shared:
        routed += 3 * a * shared + (a * h + a if spec.family.shared_expert_gate else 0)
    return routed / tp + (a * h if tp > 1 and not sp else 0)


def estimate(config, p: ParallelConfig, shapes: ModelShapes, pp_rank: int, precision: str) -> Memory:
    """All buckets of pipeline rank ``pp_rank`` at sharding index 0 (the largest shards)."""
    from xorl.models.spec import ModelSpec

    spec, train, data = ModelSpec.from_config(config.model), config.train, config.data
    fsdp = train.data_parallel_mode == "fsdp2"
    schedule, v = train.pipeline_parallel_schedule, train.virtual_pipeline_stages
    rp = rank_params(shapes, p, schedule, v, pp_rank, fsdp)
    a = 2 if fsdp and train.dtype == "bfloat16" else 4
    # LoRA: the frozen base in the compute dtype (cast_frozen_, xorl/nn/lora.py); its gradients and
    # optimizer state are the adapters' alone.
    frozen = rp.local - rp.trainable
    params = state_bytes(rp.trainable, precision)[0] + (frozen * a if frozen and precision == "fp32-master"
                                                        else state_bytes(frozen, precision)[0])
    _, grads, optimizer = state_bytes(rp.trainable, precision)
    t = data.micro_batch_size * data.seq_len // p.cp
    m = train.gradient_accumulation_steps
    sp = train.sequence_parallel and p.tp > 1
    per_kind = [activation_bytes_per_token(spec, shapes.is_moe_kind(k), a, p.tp, sp) for k in range(len(shapes.kinds))]
    per_layer = [per_kind[shapes.layer_kind[i]] for i in rp.layers]
    inflight = inflight_microbatches(schedule if p.pp > 1 else "", p.pp, m, v, pp_rank)
    mode, every = checkpointing(train)
    # The first layer the backward runs (this rank's last): its kept bytes per token, and of them
    # (and of its recompute) the MoE block's, for the experts' own FSDP unit below.
    moe_last = bool(rp.layers) and shapes.is_moe_kind(shapes.layer_kind[rp.layers[-1]])
    moe_none = moe_block_bytes_per_token(spec, a, p.tp, sp) if moe_last else 0.0
    if mode == "full":  # xorl/parallelize.py checkpoints every n-th block of each model part
        checkpointed = {i for start, n in _stage_starts(rp) for i in rp.layers[start:start + n][::every]}
        per_kept = [a * spec.hidden_size / (p.tp if sp else 1) if i in checkpointed else x
                    for i, x in zip(rp.layers, per_layer)]
        kept = sum(per_kept)
        working = max(per_layer, default=0)
        last_recomputed = bool(rp.layers) and rp.layers[-1] in checkpointed
        moe_kept = 0.0 if last_recomputed else moe_none
        attn_recompute = per_layer[-1] - moe_none if last_recomputed else 0.0
    elif mode == "selective":
        selective = [selective_bytes_per_token(spec, shapes.is_moe_kind(shapes.layer_kind[i]), a, p.tp, sp,
                                               every_other_matmul(train)) for i in rp.layers]
        per_kept, kept = selective, sum(selective)
        # one layer's element-wise outputs recomputed at a time: what it keeps without recompute, less the saved
        working = max((x - y for x, y in zip(per_layer, selective)), default=0)
        moe_kept = selective_moe_bytes_per_token(spec, a, p.tp) if moe_last else 0.0
        attn_recompute = (per_layer[-1] - moe_none) - (selective[-1] - moe_kept) if rp.layers else 0.0
    else:
        per_kept, kept, working = per_layer, sum(per_layer), 0
        moe_kept, attn_recompute = moe_none, 0.0
    held = t * inflight * (kept + 2 * a * spec.head_dim)  # kept through the forward, into the backward
    work = t * (working + max(backward_bytes_per_token(spec, shapes.is_moe_kind(k), a, p.tp, sp)
                              for k in range(len(shapes.kinds))))
    fixed = WORKSPACE_BYTES + _comm_buffers(spec, p, a, t, inflight)  # held throughout
    gathered = grad_buffers = grad_copy = experts = 0  # FSDP2: gathered parameters; one layer's gradient buffers
    head_grad_counted = False  # whether those hold lm_head's gradient (the fused loss makes it in its forward)
    # The experts' own FSDP unit (under EP, or TP: xorl/plans/data_parallel.py experts_have_own_mesh)
    # reduce-scatters their gradients when the MoE block's backward ends, the layer's attention later.
    expert_unit = fsdp and moe_last and (p.ep > 1 or p.tp > 1)
    if fsdp:
        grad_copy = 4 if a != 4 else 0
        grad_buffers = rp.largest_layer_unsharded * (a + grad_copy + 4)
        if expert_unit:  # the experts' TP/EP-local elements: what their unit gathers and reduces
            last_kind = shapes.kinds[shapes.layer_kind[rp.layers[-1]]]
            experts = sum(local_numel(n, sh, p, False, 0) for n, sh in last_kind if n in EXPERT_PARAMS)
        if p.pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES:
            gathered, grad_buffers, head_grad_counted = rp.stage_unsharded * (a + 4), 0, True
        elif not reshards_after_forward(train, p.pp):
            gathered = rp.stage_unsharded * a
        else:
            gathered = rp.largest_layer_unsharded * 2 * a + rp.root_unsharded * (a + a)
            head_grad_counted = True
    elif p.dp_cp > 1:
        fixed += DDP_BUCKET_BYTES
    loss, logits_held = (loss_bytes(spec, config.model, a, t, p.tp, p.pp == 1, m, head_grad_counted)
                         if rp.has_last else (0, 0))
    # The peak is one moment, the largest of three (gradients are created in the backward,
    # set_to_none after the optimizer step): the loss's backward (every kept activation and the
    # loss's buffers), the first layer's backward and the end of the step (every gradient and the
    # optimizer's foreach temporaries, 4 bytes per local parameter, once the activations are freed).
    # The first layer's backward: its compute (its recompute and gradient working set on top of
    # every kept activation), with one layer's gradient buffers (its unsharded gradients as they
    # are made, the previous unit's reduce-scatter in flight: for a dense layer, their sum is what
    # the allocator measures). The experts' own FSDP unit splits the layer in two (the CPU
    # allocator's timeline shows it): the MoE block's backward (compute), its experts'
    # post-backward reduce-scatter once the block has freed its own kept activations (while the
    # layer's attention part, kept or recomputed, is alive), then the attention's backward with
    # the experts' reduce-scatter in flight and the rest of the layer's gradients. Charging the
    # whole layer's gradient buffers on top of the compute overstated the MoE under TP 2 + SP,
    # whose experts are gathered whole, by 21-26 %.
    at_loss = held + loss + gathered
    at_compute = held + logits_held + work + gathered
    if expert_unit:
        rest = rp.largest_layer_unsharded - experts
        alive = held + logits_held - t * moe_kept + t * attn_recompute + gathered
        at_reduce = alive + experts * (a + grad_copy + 4)
        attn_backward = 2 * a * spec.hidden_size / (p.tp if sp else 1)  # gradients of its output and input
        at_attention = alive + t * attn_backward + experts * 4 + rest * (a + grad_copy + 4)
        layer_buffers = max(at_reduce, at_attention) - at_compute  # beyond the compute moment, when larger
        at_layer = max(at_compute, at_reduce, at_attention)
    else:
        at_layer = at_compute + grad_buffers
        layer_buffers = grad_buffers
    at_end = grads + 4 * rp.trainable
    activations = held + (loss if at_loss >= at_layer else logits_held + work)
    peak = max(at_loss, at_layer, at_end) + fixed
    # Buckets: grads are the exact gradient bytes (held at the end); other is what the peak holds
    # beyond them and the activations, at least the buffers held throughout. Where the peak comes
    # before the gradients exist, the total overstates it by at most grads - (other at the peak).
    other = max(fixed + (gathered + (max(0, layer_buffers) if at_layer > at_loss else 0) if fsdp else 0),
                peak - activations - grads)
    return Memory(params, grads, optimizer, int(activations), int(other), pp_rank, int(peak))


def _stage_starts(rp: RankParams) -> list[tuple[int, int]]:
    """(offset into rp.layers, layer count) of each stage this pipeline rank runs."""
    out, start = [], 0
    for n in rp.stage_layers:
        out.append((start, n))
        start += n
    return out


def _comm_buffers(spec, p: ParallelConfig, a: int, t: int, inflight: float) -> float:
    h, hq, hkv = spec.hidden_size, spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    out = 0.0
    if p.tp > 1:
        out += 2 * a * t * h
    if p.ulysses > 1:
        out += 2 * a * t * (hq + 2 * hkv) / p.tp
    if p.ring > 1:
        out += 2 * a * t * 2 * hkv / p.tp + 4 * t * hq / p.tp
    if p.ep > 1:  # the routed copies sent and received; under TP the block runs on t / tp tokens
        out += 2 * a * t * spec.num_experts_per_tok * h / p.tp
    if p.pp > 1:
        out += 2 * a * t * h * inflight
    return out


def peak_memory(config, p: ParallelConfig, shapes: ModelShapes, precision: str) -> Memory:
    """The pipeline rank with the largest total (every rank when there is no PP is alike)."""
    return max((estimate(config, p, shapes, r, precision) for r in range(p.pp)), key=lambda mem: mem.total)
