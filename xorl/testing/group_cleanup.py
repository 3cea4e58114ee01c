"""Rank-side clean-up between the checks of a reused GlooWorld: what a check created must not outlive it.

Why: every gloo process group holds two ``pt_gloo_runloop`` threads and a ``gloo_tcp_loop`` thread
for as long as it lives, and a check that builds a ParallelState, a DeviceMesh or a Trainer creates
a dozen groups. A rank reused for a whole suite piled up hundreds of such threads.

Why torch's DTensor caches are cleared too (xorl/_torch_compat.py ``clear_mesh_caches``): they are
keyed by DeviceMesh equality, which compares rank layouts, not process groups. A later check with an
equal mesh would be handed a DTensor spec holding the finished check's mesh, whose groups are destroyed
("Could not resolve the process group registered under the name ..."); and the cached meshes would
keep those groups' threads alive.

Why compiled code is released too (xorl/_torch_compat.py ``release_compiled_code``): dynamo's guards
and traced fake DTensors of a compiled tensor-parallel block hold the TP meshes, so their groups,
past ``torch._dynamo.reset()``; without it every compiled TP check restarted its world.

``gloo_thread_count`` is the ground truth the harness checks after the clean-up: if a check kept a
group alive anyway (a module-level cache, or a torch cache not listed here), the harness restarts
that world instead of reusing a rank that may hold a destroyed group.
"""

from __future__ import annotations

import gc
import os


def live_groups() -> set:
    from xorl._torch_compat import live_process_groups

    return live_process_groups()


def destroy_groups_not_in(keep: set) -> None:
    """Destroy every process group created since ``keep`` was taken (never the default group)."""
    import torch.distributed as dist

    from xorl._torch_compat import clear_mesh_caches, release_compiled_code, reregister_process_groups

    clear_mesh_caches()
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
