"""The parallel layer's glue: how a model is split over the mesh once, and what each step does for it.

Set-up, run once before the first step (``parallelize.py`` applies them in order, each returning a
record of what it did):
- ``pipeline_parallel.py``: the model cut into stages and the torch.distributed.pipelining schedule;
- ``tensor_parallel.py``: attention and MLP projections sharded over the TP mesh;
- ``context_parallel.py``: ring / Ulysses core attention;
- ``expert_parallel.py``: each MoE block's share of the experts, the routers' balance group;
- ``activation_checkpointing.py``: full or selective recompute per block;
- ``compile.py``: torch.compile per decoder block;
- ``data_parallel.py``: FSDP2 / HSDP sharding, DDP.

Per step (``step_plan.py``'s ``StepPlan`` answers the step's questions from the records, so the
trainer names no parallelism): ``step_reductions.py`` (what is reduced after backward and after
the optimizer step), ``pipeline_step.py`` (the stages' side inputs, tied embeddings over stages).
"""
