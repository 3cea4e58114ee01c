"""What a run tells its user: metrics, their sinks, profiles, memory and MFU.

- ``metrics.py``: metrics.jsonl, the console line, the progress bar.
- ``sinks.py``: TensorBoard and Weights & Biases.
- ``profiling.py``: torch.profiler traces and CUDA memory snapshots of chosen steps.
- ``memory_report.py``: host and device memory per rank (startup.json, export.json).
- ``mfu.py``: model FLOPs utilisation.
"""
