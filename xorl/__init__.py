"""xorl: the parallel layer (ParallelState, parallel modules, models) and the trainer."""

__version__ = "0.1.0"
