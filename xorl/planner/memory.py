"""Memory per GPU of one layout: exact where the sharded model decides it, a stated estimate elsewhere.

The parameter shapes and each rank's exact share: xorl/planner/shapes.py (model_shapes, rank_params).
The activation terms (bytes per token of a layer, microbatches in flight, the loss):
xorl/planner/activations.py. Here: bytes per bucket, the buffers, the peak (estimate, peak_memory).

EXACT (the bytes of rank_params' elements; params: the trainable ones in the master dtype, a LoRA
model's frozen base in the compute dtype, see shapes.py):

  grads      FSDP2's sharded gradient: the sharded parameter's shape in the master dtype
             (reduce_dtype fp32); ddp / none: full fp32 gradients of the local (TP/EP) parameters.
  optimizer  AdamW's exp_avg and exp_avg_sq: two fp32 tensors shaped like each local parameter
             (its `step` counter lives on the host).
  --precision fp16 counts 2 / 2 / 4 bytes per parameter instead of 4 / 4 / 8 (half-precision
  weights and gradients, 4 optimizer bytes: the assumptions of published tables, not what
  xorl-train runs).

ESTIMATED (a stated model; scripts/plan_calibrate.py compares it with torch.cuda.max_memory_allocated
on one GPU; t, a, s, h, hq, hkv as in xorl/planner/activations.py):

  other: FSDP2's unsharded blocks in flight: the largest decoder layer (TP/EP-local size) x 2 p_u
  (p_u = a), the running and the prefetched layer (only the running one where the FSDP group is one
  rank: torch makes a one-rank group's unsharded copy at its wait, not at the prefetch), and in the
  backward the layer's gradients as they are made and the previous layer's reduce-scatter input (4
  bytes a parameter) in flight, moment by moment (estimate); the root group (embedding, final norm,
  lm_head) stays gathered through the forward and the backward (its module wraps both) and holds
  lm_head's gradient from the start of backward: x (p_u + g_u); zero-bubble schedules and
  pipeline_grad_sync: per_step keep the whole stage unsharded with fp32 gradients: x (p_u + 4)
  (whatever fsdp_reshard_after_forward: a block not resharded after its backward stays gathered
  until its next forward, and the cool-down's backwards leave every block so);
  fsdp_reshard_after_forward: never keeps every layer's gathered weights to its backward: the stage
  x p_u plus one layer's gradient buffers.
  Communication buffers: TP 2 a t h, Ulysses 2 a t (hq + 2 hkv) / tp, ring 2 a t 2hkv / tp + 4 t hq
  / tp (fp32 merge), EP 2 a t k h / tp (under TP the MoE block runs on t / tp tokens), PP 2 a t h
  per microbatch in flight, ddp 128 MiB buckets; 256 MiB of kernel workspace.
  The optimizer step's foreach temporaries (4 bytes per local parameter) come when activations are
  freed.

  The peak is one moment (step_peak): the largest of the loss's backward (kept activations, the
  loss's buffers, the gathered blocks), each layer's backward in turn (kept activations, its
  recompute and gradient working set, the gathered blocks, the gradients made so far and the
  previous layer's reduce-scatter) and the end of the step (gradients and the optimizer's
  temporaries), plus what is held throughout (workspace, communication buffers). Buckets:
  activations at the peak; other, the buffers at the peak or what the peak holds beyond activations
  and gradients, whichever is larger. Held to the CPU allocator by tests/multirank/test_planner_activations.py;
  the whole grid in bench/results/plan-cpu-activations.json.
  The CPU references of the element-wise ops allocate fp32 temporaries the Triton kernels do not
  (SwiGLU's backward two [t, I] more, where a layer's backward peaks), which this GPU model leaves out.
  Reserved (what torch.cuda.max_memory_reserved reports): the total plus ALLOCATOR_OVERHEAD of the
  activations and other buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from xorl.distributed.parallel_config import (
    PIPELINE_SCHEDULES,
    ParallelConfig,
    fsdp_reshards_after_forward,
    pipeline_grad_sync_per_step,
)
from xorl.planner.activations import (
    activation_bytes_per_token,
    backward_bytes_per_token,
    checkpointing,
    compiled_unread_bytes_per_token,
    every_other_matmul,
    inflight_microbatches,
    loss_bytes,
    moe_block_bytes_per_token,
    selective_bytes_per_token,
    selective_moe_bytes_per_token,
)
from xorl.planner.shapes import EXPERT_PARAMS, ModelShapes, RankParams, is_adapter_name, local_numel, rank_params

# Zero-bubble schedules: the stage stays gathered (xorl/parallel/pipeline_parallel.py).
SPLIT_BACKWARD_SCHEDULES = tuple(name for name, info in PIPELINE_SCHEDULES.items() if info.split_backward)
PRECISIONS = {"fp32-master": (4, 4, 8), "fp16": (2, 2, 4)}  # bytes per parameter: weights, grads, optimizer
WORKSPACE_BYTES = 256 * 2**20
# ASSUMPTION until scripts/plan_calibrate.py measures max_memory_reserved against max_memory_allocated
# on a GPU: the caching allocator's block rounding and fragmentation keep about 8% more than is
# allocated of the memory that is freed and re-allocated during the step (parameters, gradients and
# optimizer state are allocated once and pack without waste).
ALLOCATOR_OVERHEAD = 0.08
DDP_BUCKET_BYTES = 2 * 64 * 2**20


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
    if mode == "full":  # xorl/parallel/parallelize.py checkpoints every n-th block of each model part
        checkpointed = {i for start, n in _stage_starts(rp) for i in rp.layers[start:start + n][::every]}
        per_kept = [a * spec.hidden_size / (p.tp if sp else 1) if i in checkpointed else x
                    for i, x in zip(rp.layers, per_layer)]
        kept = sum(per_kept)
        working = max(per_layer, default=0)
        last_recomputed = bool(rp.layers) and rp.layers[-1] in checkpointed
        moe_kept = 0.0 if last_recomputed else moe_none
        attn_recompute = per_layer[-1] - moe_none if last_recomputed else 0.0
    elif mode == "selective":
        moe_layers = [shapes.is_moe_kind(shapes.layer_kind[i]) for i in rp.layers]
        selective = [selective_bytes_per_token(spec, moe, a, p.tp, sp, every_other_matmul(train)) for moe in moe_layers]
        # train.compile: the outputs the backward never reads are not kept (activations.py)
        per_kept = [x - (compiled_unread_bytes_per_token(spec, moe, a, p.tp, sp, every_other_matmul(train))
                         if train.compile else 0) for x, moe in zip(selective, moe_layers)]
        kept = sum(per_kept)
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
    # FSDP2: gathered parameters (of them the prefetched layer); one layer's gradient buffers
    gathered = grad_buffers = grad_copy = experts = prefetched = 0
    head_grad_counted = False  # whether those hold lm_head's gradient (the fused loss makes it in its forward)
    # The experts' own FSDP unit (under EP, or TP: xorl/parallel/data_parallel.py experts_have_own_mesh)
    # reduce-scatters their gradients when the MoE block's backward ends, the layer's attention later.
    expert_unit = fsdp and moe_last and (p.ep > 1 or p.tp > 1)
    if fsdp:
        grad_copy = 4 if a != 4 else 0
        grad_buffers = rp.largest_layer_unsharded * (a + grad_copy + 4)
        if expert_unit:  # the experts' TP/EP-local elements: what their unit gathers and reduces
            last_kind = shapes.kinds[shapes.layer_kind[rp.layers[-1]]]
            experts = sum(local_numel(n, sh, p, False, 0) for n, sh in last_kind if n in EXPERT_PARAMS)
        if p.pp > 1 and pipeline_grad_sync_per_step(train):
            # torch's PipelineStage: no reshard after backward, fp32 gradients accumulated unsharded
            # until the step's one reduce-scatter; GPipe's backward and 1F1B's cool-down hold every
            # block so at once (tests/multirank/test_fsdp_memory.py counts FSDP2's buffers)
            gathered, grad_buffers, head_grad_counted = rp.stage_unsharded * (a + 4), 0, True
        elif not fsdp_reshards_after_forward(train, p.pp):
            gathered = rp.stage_unsharded * a
        else:
            # The running layer and the one its backward prefetches; a one-rank FSDP group gathers
            # nothing, and makes the prefetched layer's unsharded copy only at its own wait (the
            # experts' own unit is sharded over dp_shard x cp x tp / ep ranks).
            ep_fsdp = p.dp_shard_cp * p.tp // p.ep
            prefetched = a * ((rp.largest_layer_unsharded - experts) * (p.dp_shard_cp > 1) + experts * (ep_fsdp > 1))
            gathered = rp.largest_layer_unsharded * a + prefetched + rp.root_unsharded * (a + a)
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
    # every kept activation), and the layers after it with the gradient buffers of their moment
    # (below). The experts' own FSDP unit splits the layer in two (the CPU
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
        # with gradient accumulation every sharded gradient is held from the first microbatch on
        at_layer = max(at_compute, at_reduce, at_attention) + (grads if m > 1 else 0)
    elif grad_buffers:
        # The layers are FSDP units, each met in turn by the backward (this rank's last first). A
        # layer's compute moment (its MLP's backward) holds the gradients its backward has made by
        # then, the MLP's down projection's (its first GEMM backward), not yet the layer's others:
        # they and the layer's reduce-scatter come at its end, once its activations are freed.
        # FSDP2 keeps that reduce-scatter's input (4 bytes a parameter: fp32 gradients, or their
        # fp32 copy) until the next unit's post-backward, so every later layer computes beside one
        # in flight, with one layer's kept activations fewer and one more layer's sharded
        # gradients than the layer before it (every layer's, from the first microbatch on, with
        # gradient accumulation: each microbatch reduce-scatters into them); the last has no
        # layer to prefetch. None of this overlaps the first layer's compute, where the whole
        # layer's buffers and a reduce-scatter were charged: 6-7 % of the CPU grid's peaks
        # (bench/results/plan-cpu-activations.json) that the CPU references' fp32 temporaries hid.
        kinds = [shapes.kinds[shapes.layer_kind[i]] for i in rp.layers]
        grad_bytes = PRECISIONS[precision][1]
        alive, done = at_compute, grads if m > 1 else 0
        moments = [(alive + a * down_projection_numel(kinds[-1], p) + done, done)]
        for k in range(1, len(kinds)):
            alive -= t * per_kept[-k]
            done += grad_bytes * sharded_trainable_numel(kinds[-k], p) if m == 1 else 0
            last = k == len(kinds) - 1
            moments.append((alive + a * down_projection_numel(kinds[-1 - k], p) + 4 * rp.largest_layer_unsharded
                            - (prefetched if last else 0) + done, done))
        at_layer, done = max(moments)
        layer_buffers = at_layer - at_compute - done  # the sharded gradients are the grads bucket's
    else:
        at_layer, layer_buffers = at_compute, 0
    at_end = grads + 4 * rp.trainable
    activations = held + (loss if at_loss >= at_layer else logits_held + work)
    peak = max(at_loss, at_layer, at_end) + fixed
    # Buckets: grads are the exact gradient bytes (held at the end); other is what the peak holds
    # beyond them and the activations, at least the buffers held throughout. Where the peak comes
    # before the gradients exist, the total overstates it by at most grads - (other at the peak).
    other = max(fixed + (gathered + (max(0, layer_buffers) if at_layer > at_loss else 0) if fsdp else 0),
                peak - activations - grads)
    return Memory(params, grads, optimizer, int(activations), int(other), pp_rank, int(peak))


def down_projection_numel(kind, p: ParallelConfig) -> int:
    """The trainable TP/EP-local elements of a layer's MLP down projections (dense, shared expert,
    routed experts): the gradients the layer's backward makes first (see estimate)."""
    lora = any(is_adapter_name(n) for n, _ in kind)
    return sum(local_numel(n, sh, p, False, 0) for n, sh in kind
               if n.startswith("mlp.") and "down_proj" in n and (not lora or is_adapter_name(n)))


def sharded_trainable_numel(kind, p: ParallelConfig) -> int:
    """The trainable elements of one layer this rank holds (FSDP-sharded): its sharded gradient."""
    lora = any(is_adapter_name(n) for n, _ in kind)
    return sum(local_numel(n, sh, p, True, 0) for n, sh in kind if not lora or is_adapter_name(n))


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
