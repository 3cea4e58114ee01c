"""The activation terms of the memory estimate: bytes per token of one decoder layer (kept,
recomputed, the backward's working set), microbatches in flight, and the loss's buffers.

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
  the matmul and attention outputs and the block's input: (a (2hq + 2hkv) + 4 heads) / tp
  + 2 a h / s + (2 a I / tp + a h / s dense | (a E + a k h + 2 a k I_moe [+ 2 a I_shared + a h + a]) / tp MoE:
  the grouped GEMMs' outputs; a saved-cache census equals it, tests/unit/parallel/test_activation_checkpointing.py);
  with selective_checkpoint: every_other_matmul less the outputs of the 2nd, 4th, ... dense matmul
  of the block (block_matmuls: k, o and up of a Llama layer, a (hkv + h + I); under TP, where q, k, v
  and gate, up are one op each, o alone, a h / s), which its recompute runs again. Under
  train.compile a dense block keeps no down_proj output (a h / s less, under TP too): the compiled
  backward never reads it (compiled_unread_bytes_per_token). none and full keep the same compiled as
  eager.
  Microbatches in flight on pipeline rank r of p (m microbatches, v stages per rank): 1 without
  PP; 1F1B min(m, p - r); GPipe m; interleaved (v-1) p + 2 (p-1-r) + 1 chunks of layers/v
  layers (torch's warm-up count); ZBV min(m, p) (as 1F1B, per the zero-bubble-V paper).
  Loss (last stage, one microbatch), vocab = V / tp when TP splits the vocabulary (lm_head is
  vocabulary-parallel, xorl/nn/cross_entropy.py): t x vocab x (a + 12): the logits, the fp32
  log-softmax kept for backward and two fp32 gradient temporaries; without PP the trainer's loop
  holds the logits (a t vocab) in the model's output through the backward, and with m > 1 also
  while the next microbatch's forward runs. Under PP the last stage computes the loss in its
  forward too (fused or not) and passes on only the loss sum (xorl/parallel/pipeline_parallel.py),
  so no logits outlive the loss there: t x vocab x 12 (a + 12 for the vocabulary-parallel loss on
  bf16 logits, whose forward makes three fp32 copies beside them). With model.fused_loss (xorl_kernels/fused_linear_ce,
  default on) no logits: one chunk's [chunk, vocab] x a (chunk = default_chunk_size there,
  min(t, max(128, next_pow2(ceil(t / ceil(vocab / h)))))), d_hidden a t h and d_weight
  a vocab h, both made in the forward; d_weight is lm_head's gradient, already in the FSDP root
  group's buffers below where FSDP holds them. (The CPU reference adds one fp32 [chunk, vocab]
  temporary the Triton kernels do not allocate.)
"""

from __future__ import annotations


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
    # exponentials beside them: a + 12). Held to the CPU allocator under PP
    # (tests/multirank/test_pipeline_loss_memory.py: t V (a + 12) there was +31 %).
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


def block_matmuls(spec, moe_layer: bool, tp: int, sp: bool) -> list[list[tuple[float, float, float, float]]]:
    """The dense matmuls of one decoder block in the order it runs them, grouped in the units
    selective checkpointing keeps or recomputes whole (xorl/parallel/data_parallel.py): per matmul
    (elements its output keeps per token, tokens per token, n, k): the output on this TP rank, in
    the units of the selective terms below; the GEMM is [t x tokens, k] @ [k, n]. Without TP each
    aten mm / addmm is a unit. Under TP each TP linear is one op (xorl/nn/tp_linear_ops.py): q, k
    and v share one (their gathered input), gate and up another, and a row layer's (o, down) kept
    output is its reduced one, [t / tp, h] under SP (h / s per token), [t, h] without SP. The
    experts' grouped GEMMs are not dense matmuls (always kept); an MoE block runs on this TP rank's
    t / tp tokens, its router and shared expert as plain matmuls."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    s = tp if sp else 1
    if spec.is_mla:  # xorl/models/mla.py: q (or q_a, q_b), kv_a, kv_b, o: one GEMM per unit
        d_qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        q = ([(heads * d_qk / tp, 1, heads * d_qk / tp, h)] if spec.q_lora_rank is None
             else [(spec.q_lora_rank, 1, spec.q_lora_rank, h), (heads * d_qk / tp, 1, heads * d_qk / tp,
                                                                spec.q_lora_rank)])
        kv_a = spec.kv_lora_rank + spec.qk_rope_head_dim
        kv_b = heads * (spec.qk_nope_head_dim + spec.v_head_dim) / tp
        o = (h / s, 1, h, heads * spec.v_head_dim / tp)
        units = [[g] for g in q + [(kv_a, 1, kv_a, h), (kv_b, 1, kv_b, spec.kv_lora_rank), o]]
    else:
        hq, hkv = heads * spec.head_dim / tp, spec.num_key_value_heads * spec.head_dim / tp
        widths = [hq + 2 * hkv] if getattr(spec, "merge_qkv", False) else [hq, hkv, hkv]
        units = _tp_units([(w, 1, w, h) for w in widths], tp) + [[(h / s, 1, h, hq)]]
    if moe_layer:  # the router, then a shared expert's gate, up, down and its sigmoid gate
        shared, e = spec.shared_expert_intermediate_size, spec.num_experts
        units.append([(e / tp, 1 / tp, e, h)])
        if shared:
            units += [[(shared / tp, 1 / tp, shared, h)]] * 2 + [[(h / tp, 1 / tp, h, shared)]]
            if spec.family.shared_expert_gate:
                units.append([(1 / tp, 1 / tp, 1, h)])
        return units
    inter = spec.intermediate_size / tp
    gate_up = [2 * inter] if getattr(spec, "merge_gate_up", False) else [inter, inter]
    return units + _tp_units([(w, 1, w, h) for w in gate_up], tp) + [[(h / s, 1, h, inter)]]


def _tp_units(gemms: list, tp: int) -> list[list]:
    """Column layers sharing an input: one TP op under TP, one unit per matmul without."""
    return [gemms] if tp > 1 else [[g] for g in gemms]


def recomputed_matmuls(spec, moe_layer: bool, tp: int, sp: bool) -> list[tuple[float, float, float, float]]:
    """The matmuls every_other_matmul recomputes: its count runs over the block's matmuls (1, 2, 3,
    ...) and a unit is recomputed when all of its matmuls fall on even counts (torchtitan's
    mm_count % 2; xorl/parallel/data_parallel.py)."""
    recomputed, count = [], 0
    for unit in block_matmuls(spec, moe_layer, tp, sp):
        if all((count + i) % 2 == 0 for i in range(1, len(unit) + 1)):
            recomputed += unit
        count += len(unit)
    return recomputed


def selective_bytes_per_token(spec, moe_layer: bool, a: int, tp: int, sp: bool, every_other: bool = False
                              ) -> float:
    """One decoder layer under selective checkpointing: matmul / attention / collective outputs;
    ``every_other`` (selective_checkpoint: every_other_matmul): less the recomputed matmuls' outputs."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    hq, hkv = heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    # q, k, v, the attention's output and log-sum-exp, o_proj's output (reduced: a sequence shard
    # under SP, block_matmuls) and the block's input, which the checkpoint keeps (the previous
    # block's residual sum, recomputed there)
    kept = (a * (2 * hq + 2 * hkv) + 4 * heads) / tp + 2 * a * h / (tp if sp else 1)
    if moe_layer:
        kept += selective_moe_bytes_per_token(spec, a, tp)
    else:  # gate, up and down_proj's outputs
        kept += 2 * a * spec.intermediate_size / tp + a * h / (tp if sp else 1)
    if every_other:
        kept -= a * sum(elements for elements, *_ in recomputed_matmuls(spec, moe_layer, tp, sp))
    return kept


def compiled_unread_bytes_per_token(spec, moe_layer: bool, a: int, tp: int, sp: bool, every_other: bool) -> float:
    """What a selective block under train.compile does not keep of selective_bytes_per_token: the saved
    outputs its backward never reads. Eager SAC caches every output its policy names; a compiled
    block's partitioner saves only what the backward graph reads. In a dense block that is
    down_proj's output (its one consumer is the residual add, whose backward reads no input), a h /
    s when the policy saves it. Measured on the allocator (tests/multirank/test_planner_activations.py, FSDP 2,
    both policies): a compiled block keeps exactly [t, h] less each. Under TP down_proj is a row
    layer whose kept output is its reduced one (block_matmuls), read by nothing either: a h / s,
    measured the same way on TP 2 + SP (both policies: [t / 2, h] less a layer) and TP 2 without SP
    ([t, h] less). An MoE block's routed output is read (the combine's weight gradient), so nothing
    is counted there."""
    if moe_layer:
        return 0.0
    units = block_matmuls(spec, False, tp, sp)
    # every_other_matmul recomputes down_proj (the last matmul, a unit of its own) on an even count
    recomputed = every_other and sum(len(unit) for unit in units) % 2 == 0
    return 0.0 if recomputed else a * units[-1][0][0]


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
    # the same (the kernel recomputes its band in backward from them; tests/multirank/test_planner_activations.py):
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
    # Under TP the block runs on this rank's token shard (xorl/parallel/tensor_parallel.py); without
    # sequence parallelism it then gathers its output over TP (a h). Router: fp32 logits and
    # probabilities (8E), the top-k ids twice (int64) and weights with their normalisation
    # (24k + 12); experts: the k routed copies, their gate_up and SwiGLU outputs, and the expert
    # outputs the combine weighs (2akh + 3akI); a shared expert's gate_up and SwiGLU outputs (3aI),
    # and with its sigmoid gate the expert's output and the gate (a h + a).
    routed = 8 * spec.num_experts + 24 * k + 12 + 2 * a * k * h + 3 * a * k * spec.moe_intermediate_size
    if shared:
        routed += 3 * a * shared + (a * h + a if spec.family.shared_expert_gate else 0)
    return routed / tp + (a * h if tp > 1 and not sp else 0)
