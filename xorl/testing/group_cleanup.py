"""Rank-side clean-up between the checks of a reused GlooWorld: what a check created must not outlive it.

Why: every gloo process group holds two ``pt_gloo_runloop`` threads and a ``gloo_tcp_loop`` thread
for as long as it lives, and a check that builds a ParallelState, a DeviceMesh or a Trainer creates
a dozen groups. A rank reused for a whole suite piled up hundreds of such threads.

Why torch's DTensor caches are cleared too: they are keyed by DeviceMesh equality, which compares
rank layouts, not process groups. A later check with an equal mesh would be handed a DTensor spec
holding the finished check's mesh, whose groups are destroyed ("Could not resolve the process
group registered under the name ..."); and the cached meshes would keep those groups' threads alive.

Why compiled code is released too (``release_compiled_code``): dynamo's guards and traced fake
DTensors of a compiled tensor-parallel block hold the TP meshes, so their groups, past
``torch._dynamo.reset()``; without it every compiled TP check restarted its world.

``gloo_thread_count`` is the ground truth the harness checks after the clean-up: if a check kept a
group alive anyway (a module-level cache, or a torch cache not listed here), the harness restarts
that world instead of reusing a rank that may hold a destroyed group.
"""

from __future__ import annotations

import gc
import os
import warnings


def live_groups() -> set:
    from torch.distributed.distributed_c10d import _world

    return set(_world.pg_map)


def clear_torch_mesh_caches() -> None:
    """Drop every torch cache known to hold DeviceMesh objects (best effort: private torch APIs)."""
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
    """Reset dynamo, then drop what its reset leaves holding the finished check's compilations
    (best effort: private torch APIs, checked on torch 2.13).

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
        # Another torch moved these internals: the harness then sees the groups still alive (its
        # gloo thread count) and restarts the world, as it did before this function existed.
        warnings.warn(f"release_compiled_code: {error!r}; a compiled check may restart its world",
                      RuntimeWarning, stacklevel=2)


def _release_what_reset_leaves(torch) -> None:
    """The holders ``release_compiled_code``'s docstring lists, dropped after the reset."""
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
    # lists only objects made since the last freeze_survivors(), so this scan costs what the check
    # allocated.
    for obj in gc.get_objects():
        if issubclass(type(obj), ShapeEnv):  # type(), not isinstance: a dead weakproxy raises
            obj.tracked_fakes = None
        elif issubclass(type(obj), torch.fx.GraphModule):  # example values out; the code still runs
            for node in obj.graph.nodes:
                node.meta.clear()


def destroy_groups_not_in(keep: set) -> None:
    """Destroy every process group created since ``keep`` was taken (never the default group)."""
    import torch.distributed as dist

    from xorl._torch_compat import reregister_process_groups

    clear_torch_mesh_caches()
    release_compiled_code()
    # Collect the check's garbage while its groups still exist: collected after they are destroyed,
    # some of it (FSDP states over HSDP meshes, seen in torch 2.13) leaves them registered in C++.
    gc.collect()
    for group in live_groups() - keep - {dist.GroupMember.WORLD}:
        dist.destroy_process_group(group)
    group = None  # the loop's last group must not survive the collection below
    # The C++ name -> group registry (what functional collectives resolve names with) can hold a
    # group under more names than destroy_process_group unregisters (DeviceMesh views in torch
    # 2.13 do), so it is emptied and refilled with the groups that stay.
    reregister_process_groups(keep | {dist.GroupMember.WORLD})
    # Meshes, FSDP states and models of the finished check form reference cycles that hold the
    # groups' C++ objects (and their threads) until a collection.
    freeze_survivors()


def freeze_survivors() -> None:
    """Collect garbage, then move every object still alive (modules, torch's registries) out of
    the collector's sight.

    Why: a rank that has imported torch, xorl and transformers holds ~300k objects, and one full
    collection of them costs ~0.2 s; the clean-up runs two per call on every rank. Frozen, they
    are not scanned again, so a collection costs only what the next check allocates.
    """
    gc.collect()
    gc.freeze()


def gloo_thread_count() -> int:
    """Threads of live gloo groups in this process (0 where /proc is missing)."""
    count = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().startswith(("pt_gloo", "gloo"))
        except OSError:  # the thread ended while we looked
            pass
    return count


def settle_gloo_threads(timeout_s: float = 2.0) -> int:
    """Wait until the gloo thread count stops changing (a new thread names itself only once it has
    been scheduled, which on a loaded machine can lag its group's creation); return it."""
    import time

    deadline = time.monotonic() + timeout_s
    count = gloo_thread_count()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = gloo_thread_count()
        if now == count:
            break
        count = now
    return count
