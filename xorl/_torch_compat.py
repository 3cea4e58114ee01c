"""Every private torch API xorl uses, in one place.

Why: torch renames or moves these between releases (the GPU machines run torch 2.11, the CPU suite
2.13), so a torch upgrade is checked and fixed here rather than across the tree. Each entry says
what it is for and why no public API does the job. Heavy modules are imported on first use, as
they were at the call sites.

Left outside on purpose: ``torch._check`` and ``torch._foreach_*`` (documented, stable); and
``PipelineStage.backward_maybe_with_nosync``, which xorl/parallel/pipeline_parallel.py overrides in a
subclass (an override, not a call: it cannot be wrapped here).
"""

from __future__ import annotations

import torch.distributed as dist


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The ProcessGroup registered under ``group_name``.

    Custom ops (torch.library) take no Python objects, so ring / Ulysses attention and the MoE
    all-to-all pass their group by name and look it up inside the op, as functional collectives do.
    """
    return dist.distributed_c10d._resolve_process_group(group_name)


def flatten_mesh(mesh, name: str):
    """A 1-D view of a multi-dim DeviceMesh slice (reuses its groups; no public equivalent)."""
    return mesh._flatten(name)


def concatenate_meshes(meshes):
    """One DeviceMesh over the dims of several (HSDP: dp_replicate x dp_shard) without new groups."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def unflatten_mesh(mesh, dim: int, sizes, names):
    """Split one mesh dim into several named dims (expert parallel folds); dim as an int (torch 2.11)."""
    return mesh._unflatten(dim, sizes, names)


def compute_local_shape_and_global_offset(global_shape, mesh, placements):
    """(local shape, global offset) of this rank's piece of a DTensor layout, as DTensor computes it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as compute

    return compute(global_shape, mesh, placements)


def flatten_dense_tensors(tensors):
    """One flat buffer of ``tensors`` (bucketed gradient all-reduce), as DDP does it."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat, tensors):
    from torch._utils import _unflatten_dense_tensors

    return _unflatten_dense_tensors(flat, tensors)


def all_to_all_single_autograd(*args, **kwargs):
    """The differentiable functional all_to_all_single (the MoE dispatch; traceable by compile)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

    return a2a(*args, **kwargs)


def checkpoint_wrapper(*args, **kwargs):
    """torch's activation-checkpoint module wrapper (FSDP2-compatible; no public home yet)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(*args, **kwargs)


def live_process_groups() -> set:
    """Every process group this process has registered (the default one included, once started)."""
    from torch.distributed.distributed_c10d import _world

    return set(_world.pg_map)


def reregister_process_groups(keep) -> None:
    """Empty the C++ name -> group registry and register ``keep`` again (Trainer.close, tests' group
    clean-up): DeviceMesh views in torch 2.13 register a group under more names than
    ``destroy_process_group`` unregisters."""
    from torch._C import _distributed_c10d as c10d

    if hasattr(c10d, "_unregister_all_process_groups"):
        c10d._unregister_all_process_groups()
        for group in keep:
            c10d._register_process_group(group.group_name, group)


def clear_mesh_caches() -> None:
    """Drop every torch cache known to hold DeviceMesh objects (best effort).

    Why: DTensor's caches are keyed by DeviceMesh equality (rank layouts, not process groups) and keep
    the meshes, so the groups' C++ objects and gloo threads, alive after the groups are destroyed; a
    later equal mesh would be handed a spec naming a destroyed group. No public API clears them.
    """
    from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop
    from torch.distributed.tensor import debug as dtensor_debug

    clears = [
        getattr(dtensor_debug, "_clear_sharding_prop_cache", None),  # the Python and C++ fast-path caches
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(getattr(_collective_utils.MeshTopoInfo, "build_from_mesh", None), "cache_clear", None),
        getattr(getattr(_sharding_prop.ShardingPropagator, "_propagate_tensor_meta_cached", None),
                "cache_clear", None),
    ]
    for clear in clears:
        if clear is not None:
            clear()


def release_compiled_code() -> None:
    """Reset dynamo, then drop what its reset leaves holding the finished compilations
    (best effort, checked on torch 2.13).

    Why: a compiled block over tensor-parallel DTensor parameters guards on each parameter's
    DTensorSpec and traces fake DTensors carrying the same specs; each spec's DeviceMesh holds the
    TP process groups (C++ objects with three gloo threads each). ``torch._dynamo.reset()`` drops the
    cache entries, but these holders survive it (found with gc.get_referrers chains after a TP 2 + SP
    compiled run: 30 gloo threads, i.e. 10 groups, left per rank):

    * every compiled frame's CheckFunctionManager (its guard closures hold the DTensorSpecs) stays
      referenced by the ``weakref.finalize`` callbacks dynamo registers on each object an ID_MATCH
      guard names: torch.ops.xorl, modules, classes, code objects, i.e. objects that never die
      (torch's own comment at CheckFunctionManager.id_ref calls this a leak "by design");
    * the compiled graphs stay installed in the compiled function's module globals
      (``__compiled_fn_*`` in xorl.parallel.parallelize; their GraphModules keep fake DTensors in node meta):
      dynamo deletes them when the output code object dies, and that code object stays referenced
      from C++;
    * each compilation's ShapeEnv keeps ``tracked_fakes`` (fake DTensors with the real specs) and is
      itself kept by a cycle through C++ (fake tensors the C++ side still references) and by
      ShapeEnv's and FakeTensorMode's class-level caches. Dynamo breaks the same cycle by clearing
      ``tracked_fakes`` only after a failed trace (OutputGraph._cleanup_output_graph);
    * a traced autograd.Function (TP without SP with LoRA: copy_to_region on the adapters' path,
      tests/multirank/test_compile.py "tp2 lora") forms a cycle gc cannot see: its forward / backward
      GraphModules keep fake example values in node.meta, whose autograd graphs (C++ edges) reach
      the ApplyTemplateBackward node, whose class's forward closes over those GraphModules; the
      fakes include the LoRA parameters' fake DTensors. Dynamo's own cleanup of a failed trace
      clears node.meta for the same reason; here it is cleared on the graphs that survive.
    """
    import torch

    torch._dynamo.reset()
    try:
        _release_what_reset_leaves(torch)
    except (ImportError, AttributeError, TypeError) as error:
        # Another torch moved these internals: the compiled code's groups then stay alive (the test
        # harness sees their gloo threads and restarts its world, as before this function existed).
        import warnings

        warnings.warn(f"release_compiled_code: {error!r}; compiled code may keep its process groups alive",
                      RuntimeWarning, stacklevel=2)


def _release_what_reset_leaves(torch) -> None:
    """The holders ``release_compiled_code``'s docstring lists, dropped after the reset."""
    import gc
    import weakref

    from torch._dynamo.guards import CheckFunctionManager
    from torch._dynamo.utils import CleanupManager
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    for finalizer, info in list(weakref.finalize._registry.items()):
        owner = getattr(getattr(info.func, "func", None), "__self__", None)
        if isinstance(owner, CheckFunctionManager):
            manager = getattr(owner, "guard_manager", None)
            if getattr(manager, "cache_entry", None) is None:  # its cache entry is gone: nothing to invalidate
                finalizer.detach()
    owner = manager = info = finalizer = None
    # After the reset no cache entry can run these output codes: their globals can go.
    cleanups = CleanupManager.instance
    for hooks in list(cleanups.values.values()):
        for hook in hooks:
            hook()
    cleanups.clear()
    for attr in vars(ShapeEnv).values():
        clear = getattr(attr, "cache_clear", None)
        if callable(clear):
            clear()
    FakeTensorMode.cache_clear()
    # The ShapeEnvs and GraphModules still alive belong to the reset's compilations. gc.get_objects()
    # lists only objects made since the last gc.freeze() (the test harness freezes after each check,
    # so there the scan costs what the check allocated).
    for obj in gc.get_objects():
        if issubclass(type(obj), ShapeEnv):  # type(), not isinstance: a dead weakproxy raises
            obj.tracked_fakes = None
        elif issubclass(type(obj), torch.fx.GraphModule):  # example values out; the code still runs
            for node in obj.graph.nodes:
                node.meta.clear()
