"""The training loop and what each step needs besides the parallel layer.

- ``trainer.py``: ``Trainer`` (config -> process group -> ParallelState -> parallel model -> steps;
  ``close()`` gives its process groups back) and ``run_training``.
- ``step.py``: one optimizer step (``TrainStep``, which ``Trainer`` inherits), ``StepResult``,
  ``NonFiniteLossError``.
- ``loss.py``: the loss one process would compute, whatever the layout.
- ``grad_clip.py``: the gradient norm over every mesh dimension, without a host sync.
- ``optim.py``: AdamW and the learning-rate schedules.
- ``epochs.py``: ``train.num_epochs`` -> ``max_steps``.
- ``evaluate.py``: the validation loss on the training layout.
- ``nonfinite.py``: what a non-finite loss or gradient norm tells the user.
"""

from xorl._lazy import lazy_getattr

_EXPORTS = {
    "Trainer": ".trainer",
    "StepResult": ".step",
    "run_training": ".trainer",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
