"""The order in which `make test` (pytest -n 2 --dist loadfile) hands test files to its workers:
the longest first, so that the run does not end with one worker alone on a long file.

With ``--dist loadfile`` each file runs whole on one worker, and pytest-xdist gives the next
file in the queue to whichever worker is free. Its default queue orders files by their number
of tests, which says little about their time (test_public_models.py and test_train.py have
few tests and are among the longest; test_ddp.py, test_pipeline.py and test_learning_parity.py
came last); a long file that comes late leaves the other worker idle at the end. Longest-first is the classic greedy answer (LPT): the last files handed out are
the short ones, so both workers finish close together.

:data:`FILE_SECONDS` holds each file's measured time (pytest --durations=0, per-file sums, on
the 2-core machine, one thread per worker (tests/conftest.py); relative sizes are what matter;
a session fixture's first use counts in the file that comes first). A file not listed counts
:data:`UNKNOWN_TEST_SECONDS` per test. Re-measure when a file's time changes a lot.
"""
from __future__ import annotations

from collections import Counter

FILE_SECONDS: dict[str, float] = {
    "test_serve.py": 166, "test_public_models.py": 127, "test_train.py": 100, "test_export.py": 96,
    "test_ddp.py": 83, "test_multinode.py": 74, "test_main.py": 72, "test_prep.py": 55,
    "test_sft.py": 53, "test_tools.py": 50, "test_fsdp.py": 47, "test_public_export.py": 45,
    "test_infini.py": 42, "test_benchmark.py": 40, "test_cuda_shape.py": 40,
    "test_inference.py": 40, "test_run_tokenizer.py": 37, "test_promises.py": 35,
    "test_report.py": 34, "test_dpo.py": 33, "test_tokenizer.py": 30, "test_pipeline.py": 25,
    "test_full_disk.py": 21, "test_lora.py": 21, "test_rl.py": 16, "test_cleaner.py": 16,
    "test_shards.py": 14, "test_bench_tasks.py": 14, "test_serve_adapters.py": 13,
    "test_dataloader.py": 12, "test_fineweb.py": 11, "test_checkpoint.py": 11,
    "test_wikitext.py": 10, "test_layout.py": 8, "test_hostile_inputs.py": 8, "test_passkey.py": 7,
    "test_learning_parity.py": 6, "test_gpu_check.py": 6, "test_generation.py": 6,
    "test_special_text.py": 6, "test_status.py": 6, "test_cli.py": 4, "test_samples.py": 4,
    "test_clean_golden.py": 3, "test_eval_paths.py": 2, "test_structured.py": 2,
    "test_compiled.py": 1, "test_config.py": 1, "test_speculative.py": 1, "test_model.py": 1,
    "test_prefix_cache.py": 1, "test_metrics.py": 1, "test_docs.py": 1,
}

UNKNOWN_TEST_SECONDS = 1.0


def file_cost(name: str, n_tests: int) -> float:
    """The expected seconds of test file ``name`` (a file name, e.g. "test_train.py")."""
    return FILE_SECONDS.get(name, UNKNOWN_TEST_SECONDS * n_tests)


def longest_files_first(items: list) -> None:
    """Reorder ``items`` (pytest's collected tests) in place: files by descending
    :func:`file_cost`, each file's tests in their own order."""
    counts = Counter(it.path.name for it in items)
    items.sort(key=lambda it: -file_cost(it.path.name, counts[it.path.name]))
