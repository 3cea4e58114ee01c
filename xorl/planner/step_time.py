"""Predicted time of one optimizer step: compute at achieved efficiency, exposed communication, bubble.

A stated model, held to published runs (tests/unit/planner/test_published_dense.py) and refit on a GPU by
scripts/plan_calibrate.py. Efficiencies are fractions of the device's peaks, read from
xorl/planner/efficiency.json (each with its source: a published figure or a stated assumption).

Compute, per decoder layer and microbatch, t tokens on the rank (a = bytes per activation element):
  GEMMs   q/k/v [t, (hq + 2hkv)/tp, h], o [t, h, hq/tp] (latent attention: its low-rank down- and
          per-head up-projections, _attention_projections); dense MLP gate/up [t, 2I/tp, h], down
          [t, h, I/tp]; MoE (on the TP rank's token shard, t / tp tokens) router [t, E, h], experts
          as a grouped GEMM (t k tokens over the E/ep local experts: tokens per expert t k ep / E
          under balanced routing), a shared expert.
          Each runs at peak x gemm(m, n, k) (the efficiency curve by its smallest dimension; grouped
          GEMMs by tokens per expert), or at the HBM roofline of its bytes if that is slower, or
          the launch time if that is longer. Backward: two GEMMs of the same shape per forward GEMM.
          train.fp8: the GEMMs xorl runs in FP8 at the FP8 peak, with their operands' casts
          (xorl/planner/fp8_time.py: a difference added to the layer, nothing under fp8: none).
  attention  causal, 2 t (seq / 2) heads (d_qk + d_v) / tp FLOPs forward (seq / 2: the keys a query
          sees, fewer on gpt-oss's sliding-window layers, averaged over the layers) (documents as long
          as the row; an upper bound for packed data), 2.5x that backward, at the attention kernel's own efficiency.
  element-wise  bandwidth-bound: the bytes xorl's ops stream per token (elementwise_forward below,
          counted from xorl/models/layers.py and attention.py as eager PyTorch runs them; under
          train.compile, which compiles every block of the layouts it accepts, checkpointed TP blocks
          included (tests/multirank/test_compile_layouts.py), the fused regions read their inputs and write
          their outputs once) at
          hbm_fraction of --hbm-gbps; backward twice the forward; each op costs at least the launch
          time (launch_us: eager dispatch of one kernel).
  recompute  full: one more layer forward; selective (xorl's policy keeps matmul, attention and
          collective outputs): the element-wise forward again, and with selective_checkpoint:
          every_other_matmul the matmuls it did not keep (activations.recomputed_matmuls); none: nothing.
  last stage  lm_head [t, V/tp, h] (vocabulary-parallel under TP) 3x, and the loss: unfused,
          F.cross_entropy on fp32 logits streams (2a + 32) bytes per logit; fused
          (model.fused_loss) about 3a bytes per logit in chunks.
  optimizer  28 bytes per local parameter (AdamW read/write of weights, gradients, two moments).

Communication, NCCL-style over the topology (--gpus-per-node, --nvlink-gbps per GPU and direction,
--nics-per-node x --nic-gbps per node). A group's ranks are laid out in the mesh order pp,
dp_replicate, dp_shard, ring, ulysses, tp: a group of n ranks at stride s holds g = min(n,
gpus_per_node / s) ranks per node on N = n / g nodes. Ring all-gather / reduce-scatter of B bytes:
max(B (n-1)/n / nvlink, B (N-1)/N / (g x the node's network share per GPU)) (data crosses each
node boundary once and is forwarded over NVLink; the node's other GPUs run their own groups on
their own NICs) + one latency per ring hop; all-reduce the cheaper of the ring (twice that) and
NCCL's tree (2 B / bottleneck + 2 log2(n) latencies); all-to-all: the share bound for other
nodes over the network, the rest over NVLink. Link rates at nccl-tests' achieved fractions.
Which collectives overlap compute in xorl:
  FSDP2   all-gathers (forward, and backward when resharded) and fp32 reduce-scatters per layer and
          microbatch, the dense weights over dp_shard_cp and the experts over ep_fsdp (fsdp_groups:
          one rank a node under EP 8), are prefetched / overlapped: exposed = max(0, comm - layer compute), and the
          overlapped part slows compute by overlap_interference (NCCL's SMs and HBM traffic); the
          copy-out of each all-gather (2a bytes per element) and the cast of the gradients into the
          fp32 reduce-scatter input (a + 4) stream through HBM on the compute stream. The root
          group (embedding, norm, lm_head) and ddp's gradient all-reduce are exposed. Under
          pipeline_grad_sync: per_step (and the zero-bubble schedules) a stage reduce-scatters once
          per step after its last backward, exposed; with no reshard after forward it also gathers
          once per step, exposed, else m + 1 times a step (FSDP2's count, tests/multirank/test_fsdp_memory.py).
  TP      each TP linear's collectives (xorl/planner/tp_time.py): the column op's all-gather and
          the row op's reduce-scatter of [t, h] (all-reduce without sequence parallel), forward,
          backward (where the column op gathers its input again) and recompute, exposed with their
          layout copies; under tp_overlap the P2P ring hides each behind its own op's chunk GEMMs,
          at NCCL send/recv's rate, with the ring's interference, partial sums and chunk tails.
  Ulysses all-to-all of q, k, v and the output: exposed.
  Ring    ring - 1 K/V block transfers per layer forward (twice in backward), each overlapped with
          that step's attention.
  EP      dispatch + combine all-to-all of t h elements per destination rank a token's k experts
          reach (ep_pairs_per_token: fewer than k) per MoE layer, forward and backward; the
          shared expert runs while dispatch is in flight (xorl/nn/ep_dispatch.py), the rest is exposed.
  PP      one [t, h] send per microbatch and stage boundary each way: exposed.
Bubble: (p - 1) / v microbatch-times of the slowest pipeline rank; InterleavedZeroBubble a third
of that, ZBVZeroBubble none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xorl.distributed.parallel_config import ParallelConfig, fsdp_reshards_after_forward, pipeline_grad_sync_per_step
from xorl.observability.mfu import keys_per_query
from xorl.planner import tp_time
from xorl.planner.activations import checkpointing, every_other_matmul, fused_loss, recomputed_matmuls, vocab_split
from xorl.planner.efficiency import Efficiency, load
from xorl.planner.ep_time import ep_pairs_per_token, routed_copy_bytes
from xorl.planner.fp8_time import fp8_layer
from xorl.planner.shapes import EXPERT_PARAMS, ModelShapes, kind_numel, rank_params


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    hbm_gbps: float = 3350.0
    nvlink_gbps: float = 450.0  # per GPU, one direction
    nic_gbps: float = 50.0  # per NIC: 400 Gb/s
    nics_per_node: int = 8
    efficiency: str | None = None  # an efficiency.json other than the shipped one
    fp8_peak_tflops: float | None = None  # dense FP8; None: fp8_time.FP8_PEAK_RATIO x peak_tflops

    @property
    def net_gbps_per_gpu(self) -> float:
        return self.nic_gbps * self.nics_per_node / self.gpus_per_node


@dataclass
class StepTime:
    compute: float
    exposed_comm: float
    bubble: float

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble

    def as_dict(self) -> dict:
        return {"compute": self.compute, "exposed_comm": self.exposed_comm, "bubble": self.bubble}


class _Cost:
    def __init__(self, hw: Hardware, a: int, eff: Efficiency):
        self.hw, self.a, self.eff = hw, a, eff
        self.flops = hw.peak_tflops * 1e12
        self.hbm = hw.hbm_gbps * 1e9 * eff.hbm_fraction
        self.nvlink = hw.nvlink_gbps * 1e9 * eff.nvlink_fraction
        self.p2p = hw.nvlink_gbps * 1e9 * eff.p2p_fraction
        self.net = hw.net_gbps_per_gpu * 1e9 * eff.net_fraction

    def gemm(self, m: float, n: float, k: float, weight_elems: float | None = None, fraction: float | None = None):
        """One forward GEMM [m, k] x [k, n]: the slower of its FLOPs at the achieved fraction and its bytes."""
        weights = n * k if weight_elems is None else weight_elems
        fraction = self.eff.gemm(m, n, k) if fraction is None else fraction
        return max(2 * m * n * k / (self.flops * fraction), self.a * (m * k + weights + m * n) / self.hbm,
                   self.eff.launch_s)

    def elementwise(self, nbytes: float, ops: float) -> float:
        return max(nbytes / self.hbm, ops * self.eff.launch_s)

    def placement(self, size: int, stride: int) -> tuple[int, int]:
        """(ranks per node g, nodes N) of a group of ``size`` ranks at mesh stride ``stride``."""
        g = max(1, min(size, self.hw.gpus_per_node // stride)) if stride < self.hw.gpus_per_node else 1
        return g, -(-size // g)

    def collective(self, nbytes: float, size: int, stride: int, kind: str = "all_gather") -> float:
        """all_gather / reduce_scatter of ``nbytes`` (the full tensor), all_reduce of ``nbytes``,
        all_to_all of ``nbytes`` sent per rank, send of ``nbytes`` to the next stage."""
        if size <= 1:
            return 0.0
        e, n = self.eff, size
        g, nodes = self.placement(size, stride)
        hops_lat = (n - nodes) * e.latency_nvlink_s + (nodes if nodes > 1 else 0) * e.latency_net_s
        if kind == "all_to_all":
            return max(nbytes * (g - 1) / n / self.nvlink, nbytes * (n - g) / n / self.net) + (n - 1) * (
                e.latency_net_s if nodes > 1 else e.latency_nvlink_s)
        if kind == "send":
            return nbytes / (self.net if nodes > 1 else self.nvlink) + (e.latency_net_s if nodes > 1 else
                                                                        e.latency_nvlink_s)
        ring = max(nbytes * (n - 1) / n / self.nvlink, nbytes * (nodes - 1) / nodes / (g * self.net)) + hops_lat
        if kind != "all_reduce":
            return ring
        bottleneck = self.nvlink if nodes == 1 else min(self.nvlink, g * self.net)
        tree = 2 * nbytes / bottleneck + 2 * math.log2(n) * (e.latency_net_s if nodes > 1 else e.latency_nvlink_s)
        return min(2 * ring, tree)

    def overlapped(self, comm: float, compute: float) -> tuple[float, float]:
        """(exposed, compute slowdown) of ``comm`` overlapped with ``compute``."""
        return max(0.0, comm - compute), self.eff.overlap_interference * min(comm, compute)


def elementwise_forward(spec, moe: bool, a: int, tp: int, sp: bool, compiled: bool, ep: int = 1
                        ) -> tuple[float, float]:
    """(bytes per token, kernel launches) of one decoder layer's element-wise forward.

    Eager, per element (xorl/models/layers.py): RMSNorm (fp32 cast, pow, mean, scale, cast back,
    weight: 4a + 28 bytes, 7 ops) x 2; RoPE on q and k (x cos, rotate_half's neg and cat, x sin,
    add: 10a, 5 ops each); 2 residual adds (3a); SwiGLU (silu, product: 5a, 2 ops) per intermediate
    unit; MoE: fp32 router softmax (16 bytes per expert), the routed rows' moves (routed_copy_bytes:
    under EP the dispatch's gathers, expansions and fp32 sums, 13 more launches), the experts' and
    shared expert's SwiGLU. Compiled: each fused region reads its inputs and writes its outputs once
    (norm + residual 5a, RoPE 2a, SwiGLU 3a), one launch per region; the routed rows' moves stay as
    counted (custom ops and index scatters around them; ASSUMPTION that compile fuses none of them).
    """
    h, heads = spec.hidden_size, spec.num_attention_heads
    hq, hkv = heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    s = tp if sp else 1
    if compiled:
        norm_b, norm_ops, rope_b, res_b, glu_b, ops = 5 * a, 1, 2 * a, 0, 3 * a, 6
    else:
        norm_b, norm_ops, rope_b, res_b, glu_b, ops = 4 * a + 28, 7, 10 * a, 3 * a, 5 * a, 2 + 10 + 2
    nbytes = 2 * (norm_b + res_b) * h / s + rope_b * (hq + hkv) / tp
    ops += 2 * norm_ops
    if moe:  # on this TP rank's token shard
        k = spec.num_experts_per_tok
        moved = routed_copy_bytes(k, ep_pairs_per_token(spec.num_experts, k, ep), a, ep)
        nbytes += (16 * spec.num_experts + moved * h + glu_b * (k * spec.moe_intermediate_size
                                                                + spec.shared_expert_intermediate_size)) / tp
        ops += 12 + (13 if ep > 1 else 0)
    else:
        nbytes += glu_b * spec.intermediate_size / tp
    return nbytes, ops


def _attention_projections(spec, c: _Cost, t: int, tp: int) -> tuple[float, int, int]:
    """(forward time of the attention's projection GEMMs, q.k head dim, v head dim). Latent attention
    (xorl/models/mla.py, DeepSeek): the low-rank down-projections run whole on every TP rank
    (replicated), the per-head up-projections and o_proj split by heads (xorl/parallel/tensor_parallel.py)."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    if spec.kv_lora_rank:
        d_qk, d_v = spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim
        rank = spec.q_lora_rank
        q = (c.gemm(t, heads * d_qk / tp, h) if rank is None
             else c.gemm(t, rank, h) + c.gemm(t, heads * d_qk / tp, rank))
        kv = (c.gemm(t, spec.kv_lora_rank + spec.qk_rope_head_dim, h)
              + c.gemm(t, heads * (spec.qk_nope_head_dim + d_v) / tp, spec.kv_lora_rank))
        return q + kv + c.gemm(t, h, heads * d_v / tp), d_qk, d_v
    d = spec.head_dim
    hq, hkv = heads * d, spec.num_key_value_heads * d
    return c.gemm(t, (hq + 2 * hkv) / tp, h) + c.gemm(t, h, hq / tp), d, d


@dataclass
class _Layer:
    forward: float  # compute of one forward
    backward: float
    recompute: float
    gemm: float  # of the forward
    exposed: float  # exposed communication, forward + backward + recompute
    slowdown: float  # compute lost to overlapped communication, and what TP adds (tp_time.TPTime.compute)


def _layer(spec, moe: bool, p: ParallelConfig, c: _Cost, t: int, seq: int, sp: bool, mode: str,
           compiled: bool, every_other: bool = False, fp8: str = "none", fp8_gathered: bool = False) -> _Layer:
    a, tp = c.a, p.tp
    h, heads = spec.hidden_size, spec.num_attention_heads
    gemm, d_qk, d_v = _attention_projections(spec, c, t, tp)
    q_width, kv_width = heads * d_qk, spec.num_key_value_heads * (d_qk + d_v)  # what CP moves: q; k and v
    shared = 0.0
    if moe:  # on this TP rank's token shard (xorl/parallel/tensor_parallel.py): t / tp tokens
        k, inter, experts, tm = spec.num_experts_per_tok, spec.moe_intermediate_size, spec.num_experts, t / tp
        gemm += c.gemm(tm, experts, h)
        per_expert = tm * k * p.ep / experts
        for n_, k_ in ((2 * inter, h), (h, inter)):
            gemm += c.gemm(tm * k, n_, k_, weight_elems=experts // p.ep * n_ * k_,
                           fraction=c.eff.grouped(per_expert, n_, k_))
        if spec.shared_expert_intermediate_size:
            shared = c.gemm(tm, 2 * spec.shared_expert_intermediate_size, h) + c.gemm(
                tm, h, spec.shared_expert_intermediate_size)
            gemm += shared
    else:
        gemm += c.gemm(t, 2 * spec.intermediate_size / tp, h) + c.gemm(t, h, spec.intermediate_size / tp)
    # train.fp8: its GEMMs and their casts in place of the bf16 GEMMs above (xorl/planner/fp8_time.py)
    f8 = fp8_layer(spec, moe, p, c, t, sp, mode, every_other, fp8, fp8_gathered)
    gemm += f8.forward
    # keys per query: seq / 2 (causal), fewer on sliding-window layers (the layers' mean; xorl/observability/mfu.py)
    # q.k (d_qk) and p.v (d_v): 2 FLOPs per dim, key and query head forward
    attn_flops = 2 * t * (keys_per_query(spec, seq) / spec.num_hidden_layers) * heads * (d_qk + d_v) / tp
    attn_fwd, attn_bwd = attn_flops / (c.flops * c.eff.attn_fwd), 2.5 * attn_flops / (c.flops * c.eff.attn_bwd)
    ew_bytes, ew_ops = elementwise_forward(spec, moe, a, tp, sp, compiled, p.ep)
    ew = c.elementwise(t * ew_bytes, ew_ops)
    forward = gemm + attn_fwd + ew
    backward = 2 * gemm + attn_bwd + 2 * ew
    recompute = {"full": forward, "selective": ew}.get(mode, 0.0)
    if mode == "selective" and every_other:  # and the matmuls whose outputs it did not keep
        recompute += sum(c.gemm(t * tokens, n, k) for _, tokens, n, k in recomputed_matmuls(spec, moe, tp, sp))
    backward += f8.backward - 2 * f8.forward  # FP8's backward is not twice its forward (its own casts)
    recompute += f8.recompute if mode == "selective" else 0.0  # full recompute's forward has it
    passes = 3 if mode == "full" else 2  # forward, backward (and the recomputed forward)
    exposed = slowdown = 0.0
    if tp > 1:  # the TP linears' collectives (xorl/planner/tp_time.py)
        rows = {k for _, tokens, n, k in recomputed_matmuls(spec, moe, tp, sp) if n == h and tokens == 1
                } if mode == "selective" and every_other else set()
        batch = max(1, round(t * p.cp / seq))  # micro_batch_size: t = batch x seq / cp
        tp_cost = tp_time.layer_time(c, spec, moe, t, tp, batch, sp, p.tp_overlap, mode, rows, fp8)
        exposed, slowdown = tp_cost.exposed, tp_cost.compute
    exposed += passes * 2 * c.collective(a * t * (q_width + kv_width) / tp, p.ulysses, tp, "all_to_all")
    if moe and p.ep > 1:  # dispatch and combine: one row per (token, destination rank) pair
        pairs = ep_pairs_per_token(spec.num_experts, spec.num_experts_per_tok, p.ep)
        a2a = 2 * c.collective(a * t / tp * pairs * h, p.ep, 1, "all_to_all")
        exposed += passes * max(0.0, a2a - shared)
    if p.ring > 1:  # each step sends this rank's K/V block to its neighbour, overlapped with that step
        transfer = c.collective(a * t * kv_width / tp, 2, tp * p.ulysses, "send")
        exposed += (passes + 1) * (p.ring - 1) * max(0.0, transfer - attn_fwd / p.ring)
    return _Layer(forward, backward, recompute, gemm, exposed, slowdown)


def fsdp_groups(p: ParallelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """(size, mesh stride) of the FSDP group of a block's dense weights and of its experts.

    Dense weights shard over dp_shard_cp, whose ranks sit at stride tp. Experts under EP (or TP) are
    their own FSDP unit on the EP mesh (xorl/distributed/parallel_state.py): ("ep_fsdp", "ep") over
    the flattened dp_shard x CP x TP ranks with EP innermost, so the ep_fsdp ranks holding the same
    experts sit at stride ep: with EP 8 on 8-GPU nodes, one rank per node, every expert byte of the
    all-gather and reduce-scatter crosses the network on that rank's own NIC share, where the dense
    group's 8 ranks per node split the node's crossing between them."""
    dense = (p.dp_shard_cp, p.tp)
    return (dense, (p.ep_fsdp, p.ep)) if p.ep > 1 or p.tp > 1 else (dense, dense)


def _fsdp_split(kind, p: ParallelConfig) -> tuple[list, list]:
    """(dense, expert) parameters of a block as fsdp_groups shards them."""
    own = p.ep > 1 or p.tp > 1
    experts = [x for x in kind if own and x[0] in EXPERT_PARAMS]
    return [x for x in kind if x not in experts], experts


def step_time(config, p: ParallelConfig, shapes: ModelShapes, hw: Hardware) -> StepTime:
    from xorl.models.spec import ModelSpec

    spec, train, data = ModelSpec.from_config(config.model), config.train, config.data
    fsdp = train.data_parallel_mode == "fsdp2"
    a = 2 if fsdp and train.dtype == "bfloat16" else 4
    c = _Cost(hw, a, load(hw.efficiency))
    t, m = data.micro_batch_size * data.seq_len // p.cp, train.gradient_accumulation_steps
    sp = train.sequence_parallel and p.tp > 1
    mode = checkpointing(train)[0]
    compiled = bool(getattr(train, "compile", False))
    schedule, v = train.pipeline_parallel_schedule, train.virtual_pipeline_stages
    # train.pipeline_grad_sync per_step (zero-bubble schedules always): each stage reduce-scatters
    # once per step, after the last microbatch's backward, exposed; with its parameters kept (no
    # reshard after forward) it also gathers once per step, exposed.
    once = fsdp and p.pp > 1 and pipeline_grad_sync_per_step(train)
    resharded = fsdp_reshards_after_forward(train, p.pp)
    # all-gathers per layer and microbatch: forward and backward when resharded; per step, a stage
    # that does not reshard after backward gathers for each forward and once more for the backward
    # (m + 1: counted on FSDP2 by tests/multirank/test_fsdp_memory.py)
    gathers = (2 if not once else (m + 1) / m) if resharded else 1
    per_kind = []  # (compute, exposed communication) of one layer of each kind, per microbatch
    for k, kind in enumerate(shapes.kinds):
        layer = _layer(spec, shapes.is_moe_kind(k), p, c, t, data.seq_len, sp, mode, compiled,
                       every_other_matmul(train), train.fp8, train.fp8_all_gather)
        compute = layer.forward + layer.backward + layer.recompute + layer.slowdown
        exposed = layer.exposed
        if fsdp and not (once and not resharded):
            full = kind_numel(kind, p)
            comm = 0.0
            # FSDP2 units: the block's dense weights over dp_shard_cp, its experts (their own unit under
            # EP or TP) over ep_fsdp: two groups, two placements (fsdp_groups)
            for part, (size, stride) in zip(_fsdp_split(kind, p), fsdp_groups(p)):
                gathered = a * kind_numel(part, p)
                if train.fp8_all_gather:  # the FP8 linears' weights travel as float8: 1 byte an element
                    gathered -= (a - 1) * kind_numel([x for x in part if x[0] in shapes.fp8_linear_weights], p)
                comm += gathers * c.collective(gathered, size, stride)
                if not once:  # else once per step, below
                    comm += c.collective(4 * kind_numel(part, p), size, stride, "reduce_scatter")
                    comm += c.collective(4 * kind_numel(part, p) / size, p.dp_replicate, p.tp * p.dp_shard_cp,
                                         "all_reduce")
            e, s = c.overlapped(comm, compute)
            # FSDP2's copy-out of each all-gather into the parameters, and the cast of the bf16
            # gradients into the fp32 reduce-scatter input: HBM traffic of the compute stream.
            copies = c.elementwise((gathers * 2 * a + a + 4) * full, 2 * gathers + 1)
            exposed, compute = exposed + e, compute + s + copies
        per_kind.append((compute, exposed))
    per_rank = []
    vocab = spec.vocab_size / vocab_split(spec.vocab_size, p.tp)
    for r in range(p.pp):
        rp = rank_params(shapes, p, schedule, v, r, fsdp)
        compute = exposed = per_step = 0.0  # per microbatch, except per_step
        for i in rp.layers:
            layer_compute, layer_exposed = per_kind[shapes.layer_kind[i]]
            compute += layer_compute
            exposed += layer_exposed
        if rp.has_last:
            loss_bytes = 3 * a if fused_loss(config.model) else 2 * a + 32
            compute += 3 * c.gemm(t, vocab, spec.hidden_size) + c.elementwise(t * vocab * loss_bytes, 12)
        if p.tp > 1 and (rp.has_first or rp.has_last):  # the embedding's and lm_head's collectives
            root = tp_time.root_time(c, spec.hidden_size, vocab, t, p.tp, data.micro_batch_size, sp, p.tp_overlap,
                                     rp.has_first, rp.has_last)
            compute, exposed = compute + root.compute, exposed + root.exposed
        if once:  # each stage reduces once per step (and gathers once, kept gathered), exposed
            experts = sum(kind_numel(_fsdp_split(shapes.kinds[shapes.layer_kind[i]], p)[1], p) for i in rp.layers)
            (size, stride), (e_size, e_stride) = fsdp_groups(p)
            per_element = 4 if resharded else a + 4
            per_step += c.collective((rp.stage_unsharded - experts) * per_element, size, stride)
            per_step += c.collective(experts * per_element, e_size, e_stride) if experts else 0.0  # no empty ring
            if resharded:  # the root group's gathers stay per microbatch
                exposed += c.collective(rp.root_unsharded * a * gathers, p.dp_shard_cp, p.tp)
        elif fsdp:
            exposed += c.collective(rp.root_unsharded * (2 * a + 4), p.dp_shard_cp, p.tp)
        elif p.dp_cp > 1:
            per_step += c.collective(4 * rp.stage_unsharded, p.dp_cp, p.tp, "all_reduce")
        if p.pp > 1:  # one activation each way per stage boundary
            exposed += 2 * len(rp.stage_layers) * c.collective(a * t * spec.hidden_size, 2, p.world_size // p.pp,
                                                               "send")
        per_step += 28 * rp.trainable / c.hbm  # the optimizer step: read and write params, grads, moments
        per_rank.append((compute, exposed, per_step))
    compute_mb, exposed_mb, per_step = max(per_rank, key=lambda x: x[0] + x[1] + x[2] / m)
    bubble = 0.0
    if p.pp > 1 and schedule != "ZBVZeroBubble":
        bubble = (p.pp - 1) / v * (compute_mb + exposed_mb)
        if schedule == "InterleavedZeroBubble":
            bubble /= 3
    return StepTime(compute=m * compute_mb + per_step, exposed_comm=m * exposed_mb, bubble=bubble)


def bubble_fraction(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)
