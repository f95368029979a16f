"""Benchmark library: task data, lm-evaluation-harness-compatible scoring, model adapters, reports.

The ``benchmark`` stage (benchmark.py) only parses arguments and calls into this package:

- :mod:`utils.bench.data`     load and validate task data (hub or local), count bad rows by reason
- :mod:`utils.bench.tasks`    build requests the way lm-evaluation-harness does (prompts, targets)
- :mod:`utils.bench.scoring`  pure scoring functions (acc, acc_norm, perplexity, bits per byte,
  standard errors, rolling windows)
- :mod:`utils.bench.adapters` one interface over our checkpoints and Hugging Face causal LMs:
  batched continuation log-likelihoods, token log-probabilities, greedy generation
- :mod:`utils.bench.runner`   run the tasks on an adapter (batched, no gradients, tqdm)
- :mod:`utils.bench.report`   comparison tables, best-value highlighting, ranking, result files
- :mod:`utils.bench.core`     the CORE-style aggregate (DCLM's 22 tasks, random baselines, coverage)
- :mod:`utils.bench.contamination`  eval items' n-grams against a run's training shards, streamed

Importing any of them has no side effects. data, tasks, scoring, core and passkey need no torch
(the stage reads its task data before any model loads); adapters, runner, report and
contamination (through utils.run) import torch and transformers.
"""
