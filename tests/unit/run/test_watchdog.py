"""The heartbeat (xorl/run/watchdog.py): a heartbeat_s longer than the collective timeout is brought
before it, and the start-up says so."""

from __future__ import annotations

import threading

import pytest


class _Clock:
    """The heartbeat's ``time.monotonic``, set by the test. It counts the heartbeat thread's reads (one a
    poll while a block runs), so the test knows the thread has looked without sleeping for it."""

    def __init__(self):
        self.now, self.polls = 0.0, 0
        self._read = threading.Condition()

    def monotonic(self) -> float:
        with self._read:
            if threading.current_thread().name == "xorl-heartbeat":
                self.polls += 1
                self._read.notify_all()
            return self.now

    def wait_for_polls(self, n: int) -> None:
        with self._read:
            assert self._read.wait_for(lambda: self.polls >= n, timeout=60), "the heartbeat thread never polled"


def test_a_heartbeat_longer_than_the_timeout_is_brought_before_it_with_a_note(tmp_path, monkeypatch):
    """A run with collective_timeout_s 30 and heartbeat_s at its default 60 printed no heartbeat at all.

    The heartbeat reads the test's clock: silent at 0.39 s into the block, a line once it is past the
    interval (a third of the 1.2 s timeout), saying 0 s however loaded the machine (it read 1 s once,
    when a real sleep stood for the stall)."""
    import xorl.run.watchdog as watchdog
    from xorl.config import load_config
    from xorl.run.preflight import prepare_run
    from xorl.run.watchdog import Heartbeat

    clock = _Clock()
    monkeypatch.setattr(watchdog, "time", clock)
    lines: list[str] = []
    written = threading.Event()

    def write(line: str) -> None:
        lines.append(line)
        written.set()

    heartbeat = Heartbeat(60.0, 1.2, write=write)
    assert heartbeat.interval_s == pytest.approx(0.4)
    try:
        with heartbeat.busy("step 20"):  # a stall, which the timeout would end at 1.2 s
            clock.now = 0.39
            clock.wait_for_polls(clock.polls + 2)  # two polls that read 0.39 s
            assert lines == []
            clock.now = 0.41
            assert written.wait(timeout=60), "no heartbeat line past the interval"
    finally:
        heartbeat.close()
    assert lines[0].startswith("xorl: step 20 still running after 0 s"), lines
    config = load_config(None, ["--train.collective_timeout_s=30", f"--train.output_dir={tmp_path / 'out'}"])
    assert ("train.heartbeat_s=60 is not below train.collective_timeout_s=30: heartbeat lines every 10 s instead"
            in " ".join(prepare_run(config, 2).notes))
    config = load_config(None, ["--train.collective_timeout_s=300", f"--train.output_dir={tmp_path / 'out'}"])
    assert not any("heartbeat" in note for note in prepare_run(config, 2).notes)
