"""A run's life outside the step: checked before it starts, its folder, and how it ends.

- ``preflight.py``: ``prepare_run``: every check before any process group starts, and the
  ``RunSetup`` the trainer follows.
- ``folder.py``: the run folder (``train.output_dir``), read back without torch.
- ``lock.py``: one run per output folder.
- ``resume.py``: which settings may differ from a checkpoint's.
- ``preemption.py``: on a signal, finish the step, save, exit 75.
- ``watchdog.py``: heartbeat and hang guards.
- ``fatal.py``: an error after the process group started, shown once.
"""
