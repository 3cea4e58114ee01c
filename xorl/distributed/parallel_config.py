"""ParallelConfig: the parallel sizes of a run and the rules they must satisfy.

No torch import here: the sizes are checked before any process group exists, so a bad layout
fails in a second with a message instead of hanging N ranks in a collective.

Mesh order (outer -> inner): pp, dp_replicate, dp_shard, ringattn, ulysses, tp.
world_size = PP x DP_replicate x DP_shard x CP_ring x CP_ulysses x TP. Expert parallelism is not
a mesh dimension of its own: within a pipeline stage, EP folds over the dp_shard x CP x TP ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

from xorl.config.errors import ConfigError, did_you_mean

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "ringattn", "ulysses", "tp")
DATA_PARALLEL_MODES = ("fsdp2", "ddp", "none")


@dataclass(frozen=True)
class ScheduleInfo:
    """One pipeline schedule: the torch.distributed.pipelining class and what the plan needs to know."""

    torch_class: str  # name in torch.distributed.pipelining.schedules
    stages: Literal["one", "looped", "v"]  # per rank: one stage; virtual_pipeline_stages looped
    #                                        (rank, rank + P, ...); or two in a V (rank, 2P - 1 - rank)
    rounds: bool  # runs microbatches in rounds of pipeline_parallel_size
    split_backward: bool  # an input pass, and a later weight pass that needs the stage's parameters gathered


# The one table of pipeline schedules: config validation, the pipeline plan and FSDP's sharding
# level all read it.
PIPELINE_SCHEDULES: dict[str, ScheduleInfo] = {
    "1F1B": ScheduleInfo("Schedule1F1B", "one", rounds=False, split_backward=False),
    "GPipe": ScheduleInfo("ScheduleGPipe", "one", rounds=False, split_backward=False),
    "Interleaved1F1B": ScheduleInfo("ScheduleInterleaved1F1B", "looped", rounds=True, split_backward=False),
    "InterleavedZeroBubble": ScheduleInfo("ScheduleInterleavedZeroBubble", "looped", rounds=True,
                                          split_backward=True),
    "ZBVZeroBubble": ScheduleInfo("ScheduleZBVZeroBubble", "v", rounds=False, split_backward=True),
}


def pipeline_grad_sync_per_step(train) -> bool:
    """train.pipeline_grad_sync resolved: whether a pipeline stage reduces its gradients once per step.

    "default" is per microbatch (each FSDP2 block reshards and reduce-scatters after every
    microbatch's backward), except for the zero-bubble schedules, whose weight pass needs the
    stage gathered: they are always per step (xorl/parallel/pipeline_parallel.py). The rules refuse
    per_microbatch there, and either setting off pipeline parallelism or FSDP2 (xorl/config/rules/train.py).
    """
    setting = getattr(train, "pipeline_grad_sync", "default")
    info = PIPELINE_SCHEDULES.get(train.pipeline_parallel_schedule)
    if info is not None and info.split_backward:
        return True
    return setting == "per_step"


def fsdp_reshards_after_forward(train, pp_size: int) -> bool:
    """train.fsdp_reshard_after_forward resolved to FSDP2's flag (xorl/parallel/parallelize.py; the planner prices it).

    "default" reshards (ZeRO-3), under pipelining too: each stage then holds its parameters
    sharded plus the blocks in flight. Zero-bubble schedules are the exception: their weight pass
    needs the stage's parameters still gathered, so "default" keeps them ("always" is refused
    there up front, xorl/config/rules/train.py).
    """
    setting = getattr(train, "fsdp_reshard_after_forward", "default")
    if setting == "default":
        info = PIPELINE_SCHEDULES.get(train.pipeline_parallel_schedule)
        return not (pp_size > 1 and info is not None and info.split_backward)
    return setting == "always"


DataParallelMode = Literal["fsdp2", "ddp", "none"]
PipelineSchedule = Literal[tuple(PIPELINE_SCHEDULES)]  # type: ignore[valid-type]


@dataclass
class ParallelFields:
    """The parallel fields of the ``train:`` section (TrainConfig inherits them)."""

    # fsdp2: FSDP2 (HSDP when data_parallel_replicate_size > 1); ddp: every data-parallel rank
    # holds full weights and gradients are all-reduced over dp x cp; none: a single replica.
    data_parallel_mode: DataParallelMode = "fsdp2"
    data_parallel_replicate_size: int = 1  # HSDP: replicas of the FSDP-sharded model
    # -1: whatever world_size leaves after the other sizes.
    data_parallel_shard_size: int = -1
    tensor_parallel_size: int = 1  # ranks that split each matmul (keep inside a node)
    sequence_parallel: bool = False  # under TP: norms and activations split over the sequence too
    tp_overlap: bool = True  # under TP: overlap the matmuls with their collectives
    pipeline_parallel_size: int = 1  # pipeline stages (the model's layers split over ranks)
    pipeline_parallel_schedule: PipelineSchedule = "1F1B"  # the order stages run microbatches in
    # Stages per pipeline rank: 1 for 1F1B / GPipe, >= 2 for interleaved, exactly 2 for ZBV.
    # Ignored (like the schedule) when pipeline_parallel_size == 1.
    virtual_pipeline_stages: int = 1
    expert_parallel_size: int = 1  # ranks that split the MoE experts (within the data x context ranks)
    ulysses_parallel_size: int = 1  # context parallel by attention heads (all-to-all)
    ringattn_parallel_size: int = 1  # context parallel by sequence chunks (ring attention, zig-zag)
    # Microbatches per optimizer step; with PP these are the schedule's microbatches.
    gradient_accumulation_steps: int = 1


PARALLEL_FIELD_NAMES = tuple(f.name for f in fields(ParallelFields))


@dataclass
class ParallelConfig(ParallelFields):
    """The parallel sizes plus ``world_size``. Build with keywords or ``from_config(config, world_size)``.

    ``data_parallel_shard_size`` keeps the user's value (maybe -1); ``dp_shard`` is the resolved size.
    Short read-only sizes: ``pp, dp_replicate, dp_shard, ring, ulysses, tp, cp, dp, dp_shard_cp,
    dp_cp, ep, ep_fold, ep_fsdp`` and ``mesh_shape`` (in MESH_DIM_NAMES order).
    """

    # None: the default process group's size (init_parallel_state fills it in).
    world_size: int | None = None

    @classmethod
    def from_config(cls, config: Any, world_size: int | None) -> ParallelConfig:
        """From a ``Config`` (its ``train`` section) or anything with the parallel field names."""
        train = getattr(config, "train", config)
        return cls(**{name: getattr(train, name) for name in PARALLEL_FIELD_NAMES}, world_size=world_size)

    # -- resolved sizes --------------------------------------------------------------------
    @property
    def pp(self) -> int:
        return self.pipeline_parallel_size

    @property
    def dp_replicate(self) -> int:
        return self.data_parallel_replicate_size

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def ring(self) -> int:
        return self.ringattn_parallel_size

    @property
    def ulysses(self) -> int:
        return self.ulysses_parallel_size

    @property
    def cp(self) -> int:
        return self.ringattn_parallel_size * self.ulysses_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_parallel_size

    @property
    def dp_shard(self) -> int:
        if self.data_parallel_shard_size != -1:
            return self.data_parallel_shard_size
        if self.world_size is None:
            raise ConfigError("data_parallel_shard_size=-1 needs world_size; set ParallelConfig.world_size")
        others = self.pp * self.dp_replicate * self.tp * self.cp
        if others < 1 or self.world_size % others:
            raise ConfigError(self._product_problem(others))
        return self.world_size // others

    @property
    def dp(self) -> int:
        """Ranks that read different data (dp_replicate x dp_shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """The FSDP sharding group: CP ranks hold the same weights, so they shard them too."""
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        """Ranks whose losses and gradients are averaged together."""
        return self.dp * self.cp

    @property
    def ep_fold(self) -> int:
        """The ranks expert parallelism folds over in a stage: dp_shard x CP x TP. Why TP too: under
        TP the MoE blocks run on this rank's token shard, so the TP ranks hold different tokens and
        split the experts between them like data-parallel ranks do (EP over the TP ranks)."""
        return self.dp_shard_cp * self.tp

    @property
    def ep_fsdp(self) -> int:
        """Ranks of one pipeline stage holding the same experts (FSDP shards expert weights over them)."""
        return self.ep_fold // self.ep

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.ring, self.ulysses, self.tp)

    # -- rules -----------------------------------------------------------------------------
    def validate(self) -> ParallelConfig:
        """Raise ConfigError listing every problem (field and fix); return self when valid."""
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    def problems(self) -> list[str]:
        problems = self._basic_problems()
        if problems:  # the rules below need positive sizes and known names
            return problems
        others = self.pp * self.dp_replicate * self.tp * self.cp
        total = others * max(self.data_parallel_shard_size, 1)
        if self.data_parallel_shard_size == -1 and self.world_size % others:
            return [self._product_problem(others)]
        if self.data_parallel_shard_size != -1 and total != self.world_size:
            return [self._product_problem(others)]
        return (
            self._data_parallel_problems()
            + self._pipeline_problems()
            + self._tensor_parallel_problems()
            + self._expert_parallel_problems()
        )

    def _basic_problems(self) -> list[str]:
        problems = []
        if self.world_size is None:
            problems.append("ParallelConfig.world_size is not set; pass the number of ranks")
        elif isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            problems.append(f"world_size={self.world_size!r} must be a positive integer")
        for name in (
            "data_parallel_replicate_size",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "virtual_pipeline_stages",
            "expert_parallel_size",
            "ulysses_parallel_size",
            "ringattn_parallel_size",
            "gradient_accumulation_steps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"train.{name}={value!r} must be an integer >= 1")
        shard = self.data_parallel_shard_size
        if isinstance(shard, bool) or not isinstance(shard, int) or (shard < 1 and shard != -1):
            problems.append(
                f"train.data_parallel_shard_size={shard!r} must be >= 1, or -1 to use the ranks "
                "the other sizes leave"
            )
        if self.data_parallel_mode not in DATA_PARALLEL_MODES:
            problems.append(
                f"train.data_parallel_mode={self.data_parallel_mode!r} is not one of {DATA_PARALLEL_MODES}"
                + did_you_mean(str(self.data_parallel_mode), DATA_PARALLEL_MODES)
            )
        if self.pipeline_parallel_schedule not in PIPELINE_SCHEDULES:
            problems.append(
                f"train.pipeline_parallel_schedule={self.pipeline_parallel_schedule!r} is not one of "
                f"{list(PIPELINE_SCHEDULES)}"
                + did_you_mean(str(self.pipeline_parallel_schedule), list(PIPELINE_SCHEDULES))
            )
        return problems

    def _product_problem(self, others: int) -> str:
        sizes = (
            f"pipeline_parallel_size={self.pp} x data_parallel_replicate_size={self.dp_replicate} x "
            f"data_parallel_shard_size={self.data_parallel_shard_size} x "
            f"ringattn_parallel_size={self.ring} x ulysses_parallel_size={self.ulysses} x "
            f"tensor_parallel_size={self.tp}"
        )
        if self.data_parallel_shard_size == -1:
            return (
                f"the parallel sizes must multiply to world_size={self.world_size}, but {sizes}: the other "
                f"sizes multiply to {others}, which does not divide {self.world_size}; change them or "
                f"launch a multiple of {others} ranks"
            )
        total = others * self.data_parallel_shard_size
        return (
            f"the parallel sizes must multiply to world_size={self.world_size}, but {sizes} = {total}; "
            f"change the sizes, set data_parallel_shard_size: -1 to fill in the rest, or launch {total} ranks"
        )

    def _data_parallel_problems(self) -> list[str]:
        problems = []
        if self.data_parallel_mode == "none" and self.dp > 1:
            problems.append(
                f"train.data_parallel_mode='none' but the data-parallel size is {self.dp} "
                f"(data_parallel_replicate_size={self.dp_replicate} x "
                f"data_parallel_shard_size={self.dp_shard}); "
                "use data_parallel_mode 'fsdp2' or 'ddp', or make both sizes 1"
            )
        if self.data_parallel_mode == "none" and self.cp > 1:
            problems.append(
                f"train.data_parallel_mode='none' cannot reduce gradients across the {self.cp} "
                "context-parallel ranks (ringattn_parallel_size x ulysses_parallel_size) that share the weights; "
                "use data_parallel_mode 'fsdp2' or 'ddp'"
            )
        return problems

    def _pipeline_problems(self) -> list[str]:
        if self.pp == 1:
            return []  # schedule fields do not apply
        problems = []
        steps, schedule = self.gradient_accumulation_steps, self.pipeline_parallel_schedule
        info = PIPELINE_SCHEDULES.get(schedule)
        if info is None:
            return []  # reported by _basic_problems
        virtual = self.virtual_pipeline_stages
        if steps < self.pp:
            problems.append(
                f"train.gradient_accumulation_steps={steps} is below pipeline_parallel_size={self.pp}: "
                "a pipeline schedule needs at least one microbatch per stage; "
                f"set gradient_accumulation_steps >= {self.pp}"
            )
        elif info.rounds and steps % max(1, steps // self.pp):
            problems.append(
                f"train.gradient_accumulation_steps={steps}: {schedule} runs microbatches in rounds of "
                f"pipeline_parallel_size={self.pp} and needs a multiple of {max(1, steps // self.pp)}; "
                f"use a multiple of {self.pp} (e.g. {self.pp * max(1, steps // self.pp)})"
            )
        if info.stages == "v" and virtual != 2:
            problems.append(
                f"train.virtual_pipeline_stages={virtual}: {schedule} places exactly 2 stages on each "
                "pipeline rank; set virtual_pipeline_stages: 2"
            )
        elif info.stages == "looped" and virtual < 2:
            problems.append(
                f"train.virtual_pipeline_stages={virtual}: {schedule} interleaves several stages per "
                "pipeline rank; set virtual_pipeline_stages >= 2, or use pipeline_parallel_schedule 1F1B"
            )
        elif info.stages == "one" and virtual != 1:
            problems.append(
                f"train.virtual_pipeline_stages={virtual}: {schedule} runs one stage per pipeline rank; "
                "set virtual_pipeline_stages: 1, or use an interleaved schedule (Interleaved1F1B)"
            )
        return problems

    def _tensor_parallel_problems(self) -> list[str]:
        if self.sequence_parallel and self.tp == 1:
            return [
                "train.sequence_parallel=true requires tensor_parallel_size > 1 (it shards the "
                "activations between TP regions over the TP group); set sequence_parallel: false "
                "or raise tensor_parallel_size"
            ]
        return []

    def _expert_parallel_problems(self) -> list[str]:
        if self.ep_fold % self.ep:
            fold = self.ep_fold
            divisors = [d for d in range(1, fold + 1) if fold % d == 0]
            return [
                f"train.expert_parallel_size={self.ep} must divide the ranks it folds over within a "
                f"pipeline stage: data_parallel_shard_size={self.dp_shard} x "
                f"ringattn_parallel_size={self.ring} x ulysses_parallel_size={self.ulysses} x "
                f"tensor_parallel_size={self.tp} = {fold}; use one of {divisors} "
                f"(or make data_parallel_shard_size a multiple of "
                f"{self.ep // math.gcd(self.ep, self.cp * self.tp)})"
            ]
        return []
