"""Training: the loop and what it is built from.

- :mod:`utils.training.trainer`       the Trainer, its spec of parts, optimizers, stop requests
- :mod:`utils.training.scheduler`     learning-rate schedules
- :mod:`utils.training.metrics`       tokens/s, MFU, peak memory
- :mod:`utils.training.logging_utils` TensorBoard + JSONL metrics of a run
- :mod:`utils.training.checkpoint`    checkpoint files: atomic save, safe load, validation
- :mod:`utils.training.distributed`   torchrun / DDP set-up and collectives
- :mod:`utils.training.allocator`     the CUDA caching-allocator setting a stage starts with

Importing any of them has no side effects.
"""
