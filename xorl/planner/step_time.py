"""Predicted time of one optimizer step: compute, exposed communication, pipeline bubble.

A stated model, not a measurement: a lower bound that ranks layouts against each other.

Compute. Every matmul is a roofline: time = max(2 m n k / peak, a (m k + k n + m n) / hbm), with
peak (--peak-tflops) and hbm (--hbm-gbps) the device's; a = bytes per activation element.
Per decoder layer and microbatch, t tokens on the rank: q/k/v [t, (hq + 2hkv)/tp, h], o
[t, h, hq/tp]; dense MLP gate, up and down together [t, 3I/tp, h]; MoE router [t, E, h], experts
[t k, 3 I_moe, h] with all E/ep local expert weights read, a shared expert [t, 3 I_shared, h]
(MoE runs whole on every TP rank: TP does not split it). Causal attention: 2 t seq hq / tp
FLOPs (2 FLOPs x 2 matmuls x seq / 2 keys per query on average; documents as long as the row,
an upper bound for packed data), its q/k/v/o bytes once. Elementwise work (norms, RoPE, SwiGLU, residuals)
streams twice the layer's saved activations through HBM. Backward costs twice the forward; full
recompute adds one more layer forward. The last stage adds lm_head [t, V, h] and the loss
(t V (a + 12) bytes through HBM), the optimizer step 28 bytes per local parameter.

Communication, from link bandwidths: a group whose ranks stay inside one node (stride x size <=
--gpus-per-node in the mesh order pp, dp_replicate, dp_shard, ring, ulysses, tp) runs at
--nvlink-gbps, else at --ib-gbps. All-gather / reduce-scatter of B bytes over n ranks:
B (n-1)/n / bw; all-reduce twice that; all-to-all of B bytes sent: B (n-1)/n / bw.
  FSDP2   per layer and microbatch: all-gather in forward and again in backward (once with
          fsdp_reshard_after_forward: never; 2-byte weights under bf16 compute), reduce-scatter
          of fp32 gradients (+ all-reduce over dp_replicate under HSDP); prefetched, so
          exposed = max(0, comm - layer compute). The root group (embedding, norm, lm_head)
          and zero-bubble stages (gathered once per step) are exposed whole; ddp all-reduces fp32
          gradients once per step, exposed.
  TP      4 all-gathers / reduce-scatters of [t, h] per dense layer in forward (3 per MoE layer),
          as many in backward, again in recompute; with tp_overlap hidden behind the layer's matmuls.
  Ulysses all-to-all of q, k, v and of the output, forward and backward (and recompute); exposed.
  Ring    ring - 1 K/V block transfers per layer forward, twice that in backward, each overlapped
          with that step's attention: exposed = (ring - 1) max(0, transfer - attention step).
  EP      dispatch + combine all-to-all of t k h elements per MoE layer, forward and backward; exposed.
  PP      one [t, h] send per microbatch and stage boundary each way; exposed.
Bubble: (p - 1) / v microbatch-times of the slowest pipeline rank, so the bubble fraction is
(p - 1) / (v m + p - 1) (v = 1 without interleaving); InterleavedZeroBubble a third of that
(its weight passes fill the rest), ZBVZeroBubble none.
"""

from __future__ import annotations

from dataclasses import dataclass

from xorl.distributed.parallel_config import ParallelConfig
from xorl.planner.memory import (
    SPLIT_BACKWARD_SCHEDULES,
    ModelShapes,
    activation_bytes_per_token,
    checkpointing,
    kind_numel,
    rank_params,
    reshards_after_forward,
)


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    hbm_gbps: float = 3350.0
    nvlink_gbps: float = 450.0  # per GPU, one direction
    ib_gbps: float = 50.0  # per GPU: one 400 Gb/s NIC each


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
    def __init__(self, hw: Hardware, a: int):
        self.hw, self.a = hw, a
        self.flops = hw.peak_tflops * 1e12
        self.hbm = hw.hbm_gbps * 1e9

    def gemm(self, m: float, n: float, k: float, weight_elems: float | None = None) -> float:
        weights = n * k if weight_elems is None else weight_elems
        return max(2 * m * n * k / self.flops, self.a * (m * k + weights + m * n) / self.hbm)

    def bandwidth(self, stride: int, size: int) -> float:
        inside = stride * size <= self.hw.gpus_per_node
        return (self.hw.nvlink_gbps if inside else self.hw.ib_gbps) * 1e9

    def collective(self, nbytes: float, size: int, stride: int) -> float:
        """All-gather / reduce-scatter of ``nbytes`` (the full tensor), or all-to-all of ``nbytes`` sent."""
        return 0.0 if size <= 1 else nbytes * (size - 1) / size / self.bandwidth(stride, size)


@dataclass
class _Layer:
    compute: float  # one forward
    comm: float  # exposed communication of one forward (TP, Ulysses, EP); backward repeats it
    ring: float  # exposed ring transfers of one forward (backward: twice)


def _layer(spec, moe: bool, p: ParallelConfig, c: _Cost, t: int, seq: int, sp: bool) -> _Layer:
    a, tp = c.a, p.tp
    h, d, heads = spec.hidden_size, spec.head_dim, spec.num_attention_heads
    hq, hkv = heads * d, spec.num_key_value_heads * d
    gemm = c.gemm(t, (hq + 2 * hkv) / tp, h) + c.gemm(t, h, hq / tp)
    attn = max(2 * t * seq * hq / tp / c.flops, a * t * (2 * hq + 2 * hkv) / tp / c.hbm)
    if moe:
        k, inter = spec.num_experts_per_tok, spec.moe_intermediate_size
        gemm += c.gemm(t, spec.num_experts, h)
        gemm += c.gemm(t * k, 3 * inter, h, weight_elems=spec.num_experts // p.ep * 3 * inter * h)
        if spec.shared_expert_intermediate_size:
            gemm += c.gemm(t, 3 * spec.shared_expert_intermediate_size, h)
    else:
        gemm += c.gemm(t, 3 * spec.intermediate_size / tp, h)
    elementwise = 2 * t * activation_bytes_per_token(spec, moe, a, tp, sp) / c.hbm
    tp_comm = (3 if moe else 4) * c.collective(a * t * h, tp, 1)
    comm = max(0.0, tp_comm - gemm) if p.tp_overlap else tp_comm
    comm += c.collective(a * t * (2 * hq + 2 * hkv) / tp, p.ulysses, tp)
    if moe:
        comm += 2 * c.collective(a * t * spec.num_experts_per_tok * h, p.ep, tp)
    ring = 0.0
    if p.ring > 1:  # each step sends this rank's K/V block (t tokens' worth) to its neighbour
        transfer = a * t * 2 * hkv / tp / c.bandwidth(tp * p.ulysses, p.ring)
        ring = (p.ring - 1) * max(0.0, transfer - attn / p.ring)
    return _Layer(gemm + attn + elementwise, comm, ring)


def step_time(config, p: ParallelConfig, shapes: ModelShapes, hw: Hardware) -> StepTime:
    from xorl.models.spec import ModelSpec

    spec, train, data = ModelSpec.from_config(config.model), config.train, config.data
    fsdp = train.data_parallel_mode == "fsdp2"
    a = 2 if fsdp and train.dtype == "bfloat16" else 4
    c = _Cost(hw, a)
    t, m = data.micro_batch_size * data.seq_len // p.cp, train.gradient_accumulation_steps
    sp = train.sequence_parallel and p.tp > 1
    forwards = 2 if checkpointing(train)[0] == "full" else 1  # the forward, and its recompute
    gathers = 2 if reshards_after_forward(train, p.pp) else 1  # all-gathers per layer and microbatch
    schedule, v = train.pipeline_parallel_schedule, train.virtual_pipeline_stages
    zero_bubble = p.pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES
    per_kind = []  # (compute, exposed communication) of one layer of each kind, per microbatch
    for k, kind in enumerate(shapes.kinds):
        layer = _layer(spec, shapes.is_moe_kind(k), p, c, t, data.seq_len, sp)
        compute = (forwards + 2) * layer.compute
        exposed = (forwards + 1) * layer.comm + (forwards + 2) * layer.ring
        if fsdp and not zero_bubble:
            full = kind_numel(kind, p)
            comm = c.collective((gathers * a + 4) * full, p.dp_shard_cp, p.tp)
            comm += 2 * c.collective(4 * full / p.dp_shard_cp, p.dp_replicate, p.tp * p.dp_shard_cp)
            exposed += max(0.0, comm - compute)
        per_kind.append((compute, exposed))
    per_rank = []
    for r in range(p.pp):
        rp = rank_params(shapes, p, schedule, v, r, fsdp)
        compute = exposed = per_step = 0.0  # per microbatch, except per_step
        for i in rp.layers:
            layer_compute, layer_exposed = per_kind[shapes.layer_kind[i]]
            compute += layer_compute
            exposed += layer_exposed
        if rp.has_last:
            compute += 3 * c.gemm(t, spec.vocab_size, spec.hidden_size) + t * spec.vocab_size * (a + 12) / c.hbm
        if fsdp and zero_bubble:
            per_step += c.collective(rp.stage_unsharded * (a + 4), p.dp_shard_cp, p.tp)
        elif fsdp:
            exposed += c.collective(rp.root_unsharded * (2 * a + 4), p.dp_shard_cp, p.tp)
        elif p.dp_cp > 1:
            per_step += 2 * c.collective(4 * rp.stage_unsharded, p.dp_cp, p.tp)
        if p.pp > 1:  # one activation each way per stage boundary
            exposed += 2 * len(rp.stage_layers) * a * t * spec.hidden_size / c.bandwidth(p.world_size // p.pp, 2)
        per_step += 28 * rp.local / c.hbm  # the optimizer step: read and write params, grads, moments
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
