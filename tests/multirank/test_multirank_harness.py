"""The multi-rank harness itself: results come back per rank, errors and hangs fail with a message
naming the call, a rank that dies in a Trainer's step fails the call rather than hanging it, a late
answer never passes for the next call's, and checks leave no groups behind."""

import os
import signal
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from tests.support.parity_runs import tiny_config, train_with_rank_dying
from xorl.testing.multirank import GlooWorld, RankError, set_deadline

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow  # every test here starts gloo worlds


def _all_reduce_rank() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("planted failure")
    return dist.get_rank()


def _hang_on_rank_zero() -> None:
    # Rank 0 waits on a collective that rank 1 never joins.
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(0.1)


def _answer_after(tag: str, delay_s: float) -> tuple[str, int]:
    time.sleep(delay_s)
    return tag, dist.get_rank()


def _answer_when(tag: str, release: str) -> tuple[str, int]:
    """Answer once the file ``release`` exists: a call that stays unanswered exactly as long as the
    test wants (no sleep that a loaded machine could outlast before the harness's timer fires)."""
    while not os.path.exists(release):
        time.sleep(0.01)
    return tag, dist.get_rank()


def test_results_come_back_per_rank(gloo_world):
    world = gloo_world(4)
    assert world.run(_all_reduce_rank) == [10.0] * 4


def test_error_on_one_rank_names_it_and_world_recovers():
    with GlooWorld(2, timeout_s=60) as world:
        with pytest.raises(RankError, match="planted failure") as info:
            world.run(_fail_on_rank_one)
        assert "ranks [1]" in str(info.value)
        assert world.run(_all_reduce_rank) == [3.0, 3.0]  # restarted transparently


def test_hang_becomes_timeout_error():
    with GlooWorld(2, timeout_s=60) as world:
        # The call's own limit (2 s), not the world's 60 s, is the one that ended it.
        with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not finish within 2s"):
            world.run(_hang_on_rank_zero, timeout_s=2)


def test_a_timed_out_call_is_reported_with_its_id_and_the_next_call_gets_its_own_answer(tmp_path):
    release = str(tmp_path / "release")
    with GlooWorld(2, timeout_s=60) as world:
        assert world.run(_answer_after, "first", 0) == [("first", 0), ("first", 1)]
        with pytest.raises(TimeoutError, match=r"call #2 _answer_when: ranks \[0, 1\] of 2"):
            world.run(_answer_when, "late", release, timeout_s=0.5)  # unanswered until released
        # Released before the next call: ranks that lived would answer "late" first (in order).
        open(release, "w").close()
        assert world.run(_answer_after, "third", 0) == [("third", 0), ("third", 1)]
        assert world.starts == 2  # the timed-out world was torn down and started again


def test_an_interrupted_call_never_answers_the_next_one(tmp_path):
    """pytest-timeout (signal method) interrupts the wait with an exception from a signal handler;
    the ranks are still running the call and will answer it later."""
    release = str(tmp_path / "release")

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    with GlooWorld(2, timeout_s=60) as world:
        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(Interrupted):
                world.run(_answer_when, "late", release)  # unanswered until released
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        # Released before the next call: ranks that lived would answer "late" first (in order).
        open(release, "w").close()
        assert world.run(_answer_after, "next", 0) == [("next", 0), ("next", 1)]


def test_the_deadline_cuts_a_call_short_and_says_so(tmp_path):
    with GlooWorld(2, timeout_s=60) as world:
        previous = set_deadline(time.monotonic() + 1.5)
        try:
            # Cut at the deadline (the call is never released), not at the call's own 60 s timeout.
            with pytest.raises(TimeoutError, match=r"call #1 _answer_when: .* by the test's deadline"):
                world.run(_answer_when, "slow", str(tmp_path / "never"))
        finally:
            set_deadline(previous)


def test_the_harness_reports_the_hung_call_before_pytest_timeout_fires(pytester):
    """The real thing: tests/conftest.py's hook sets the deadline from pytest-timeout's timer."""
    pytester.makeconftest("from tests.conftest import pytest_timeout_cancel_timer, pytest_timeout_set_timer\n")
    # Only the test function is timed, so the world's start-up (in the fixture) is not.
    pytester.makeini("[pytest]\ntimeout_func_only = true\n")
    pytester.makepyfile(
        """
        import pytest
        from tests.multirank.test_multirank_harness import _answer_after
        from xorl.testing.multirank import GlooWorld

        @pytest.fixture(scope="module")
        def world():
            with GlooWorld(1, timeout_s=300) as world:
                yield world

        @pytest.mark.timeout(8)  # deadline at 6 s: 2 s for the harness to kill the rank and raise
        def test_hangs(world):
            world.run(_answer_after, "slow", 60)
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "call #1 _answer_after: ranks [0] of 1 did not finish by the test's deadline" in out
    assert "from pytest-timeout" not in out  # pytest-timeout's own "Timeout (>8.0s)" never came


def _gloo_threads() -> Counter:
    names = Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:  # the thread ended while we looked
            pass
    return Counter({k: v for k, v in names.items() if k.startswith(("pt_gloo", "gloo"))})


def _build_groups() -> dict:
    """What checks create: a ParallelState (DeviceMesh, flattened views, EP mesh) and a new_group."""
    from torch.distributed.device_mesh import init_device_mesh

    from xorl.distributed import ParallelConfig, init_parallel_state

    state = init_parallel_state(ParallelConfig(data_parallel_shard_size=2, ringattn_parallel_size=2,
                                               expert_parallel_size=2))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    pair = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=state.cp_group)
    dist.all_reduce(t, group=mesh.get_group("b"))
    if dist.get_rank() < 2:
        dist.all_reduce(t, group=pair)
    return _gloo_threads()


def test_checks_leave_no_process_groups_or_gloo_threads_behind(gloo_world):
    world = gloo_world(4)
    before = world.run(_gloo_threads)
    starts = world.starts
    during = [world.run(_build_groups) for _ in range(5)]
    after = world.run(_gloo_threads)
    assert world.starts == starts  # the same ranks throughout (a leak would have restarted them)
    for rank in range(4):
        # The check really made groups (so this test can fail) ...
        assert all(sum(d[rank].values()) >= sum(before[rank].values()) + 20 for d in during), during
        # ... and none of them outlived it: only the default group's threads remain.
        assert after[rank] == before[rank], (rank, before[rank], after[rank])


_KEPT_GROUPS = []


def _keep_a_group_in_a_global() -> int:
    _KEPT_GROUPS.append(dist.new_group([0, 1]))
    return len(_KEPT_GROUPS)


def test_a_check_that_keeps_a_group_gets_a_warning_and_a_fresh_world():
    with GlooWorld(2, timeout_s=60) as world:
        with pytest.warns(RuntimeWarning, match=r"call #1 _keep_a_group_in_a_global kept process groups alive"):
            assert world.run(_keep_a_group_in_a_global) == [1, 1]
        # The rank holding the destroyed group is gone: the next call runs on fresh ranks.
        assert world.run(_all_reduce_rank) == [3.0, 3.0]
        assert world.starts == 2


def _compiled_tp_training(output_dir: str, lora: dict | None, sequence_parallel: bool) -> Counter:
    """The real Trainer, TP 2, train.compile (aot_eager), one step; the gloo threads alive at its
    end (its groups still alive)."""
    from tests.support.compile_checks import train_and_count

    train_and_count(output_dir, "llama", 1, "aot_eager", lora=lora, eager=False, tensor_parallel_size=2,
                    sequence_parallel=sequence_parallel, data_parallel_shard_size=1)
    return _gloo_threads()


# The two ways a compiled TP run held its groups (_torch_compat.release_compiled_code): guards and traced
# fakes over the TP DTensors (TP + SP), and a traced autograd.Function's cycle (LoRA's copy_to_region).
_COMPILED_TP_RUNS = [(None, True), (dict(rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "o_proj"]), False)]


# release_compiled_code reaches into dynamo's internals as torch 2.13 holds them; under torch 2.11 (the
# GPU image, scripts/compat_check.sh) 20 gloo threads a rank still stay held after it and the harness
# restarts the world as before this clean-up existed (found, not chased: the holders differ there).
@pytest.mark.skipif(torch.__version__ < "2.13", reason="release_compiled_code is verified on torch 2.13 only; "
                    "older torch keeps other holders and the harness restarts the world instead")
def test_a_compiled_tensor_parallel_run_leaves_no_groups_behind(gloo_world, tmp_path):
    """Compiled blocks over TP DTensor parameters (TP + SP; TP + LoRA without SP): dynamo's guards and
    traced fakes hold the TP meshes (so their groups) past torch._dynamo.reset();
    xorl/_torch_compat.py release_compiled_code drops them. Measured before it: 30 gloo threads (10 groups)
    left per rank after each run, the world restarted per call."""
    world = gloo_world(2)
    before = world.run(_gloo_threads)
    starts = world.starts
    during = [world.run(_compiled_tp_training, str(tmp_path / str(i)), lora, sp, timeout_s=540)
              for i, (lora, sp) in enumerate(_COMPILED_TP_RUNS)]
    after = world.run(_gloo_threads)
    assert world.starts == starts  # no call kept a group (a leak warns and restarts the world)
    for rank in range(2):
        assert all(sum(d[rank].values()) >= sum(before[rank].values()) + 20 for d in during), during
        assert after[rank] == before[rank], (rank, before[rank], after[rank])


FSDP2 = dict(data_parallel_shard_size=2, gradient_accumulation_steps=2)


@pytest.mark.slow
def test_a_dying_rank_makes_the_others_fail_not_hang(tmp_path):
    with GlooWorld(2, timeout_s=120) as world:
        start = time.monotonic()
        with pytest.raises(RankError) as info:
            world.run(train_with_rank_dying, tiny_config(str(tmp_path), max_steps=5, **FSDP2), 1, 2)
        assert time.monotonic() - start < 100
        assert "rank 1" in str(info.value)
