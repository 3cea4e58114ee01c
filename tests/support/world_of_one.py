"""A Trainer in the test's own process, with no launcher: the Trainer starts the default group itself
(xorl/distributed/init.py's world of one), as a script or a notebook does."""

from __future__ import annotations


def world_of_one(monkeypatch) -> None:
    """The environment of a plain ``python`` process (no MASTER_ADDR); what init_distributed writes
    into it (RANK, WORLD_SIZE, LOCAL_RANK) is undone with the test."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
