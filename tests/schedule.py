"""The order in which `make test` (pytest -n 2 --dist loadfile) hands test files to its workers:
the longest first, so that the run does not end with one worker alone on a long file.

With ``--dist loadfile`` each file runs whole on one worker, and pytest-xdist gives the next
file in the queue to whichever worker is free. Its default queue orders files by their number
of tests, which says little about their time (test_train.py has few tests and is the longest
file; test_serve.py has the most); a long file that comes late leaves the other worker idle
at the end. Longest-first is the classic greedy answer (LPT): the last files handed out are
the short ones, so both workers finish close together.

:data:`FILE_SECONDS` holds each file's measured time (pytest --durations=0, per-file sums, on
the 2-core machine; relative sizes are what matter). A file not listed counts
:data:`UNKNOWN_TEST_SECONDS` per test. Re-measure when a file's time changes a lot.
"""
from __future__ import annotations

from pathlib import Path

FILE_SECONDS: dict[str, float] = {
    "test_train.py": 435, "test_public_export.py": 406, "test_serve.py": 313, "test_sft.py": 284,
    "test_report.py": 283, "test_export.py": 272, "test_benchmark.py": 225,
    "test_public_models.py": 490, "test_dpo.py": 183, "test_ddp.py": 180, "test_main.py": 163,
    "test_infini.py": 154, "test_fsdp.py": 150, "test_lora.py": 130, "test_promises.py": 130,
    "test_prep.py": 129, "test_run_tokenizer.py": 100, "test_rl.py": 90, "test_tokenizer.py": 69,
    "test_inference.py": 60, "test_pipeline.py": 45, "test_learning_parity.py": 45,
    "test_compiled.py": 40, "test_generation.py": 40, "test_shards.py": 39, "test_status.py": 37,
    "test_hostile_inputs.py": 36, "test_cleaner.py": 34, "test_special_text.py": 30,
    "test_speculative.py": 30, "test_prefix_cache.py": 30, "test_full_disk.py": 30,
    "test_eval_paths.py": 30, "test_fineweb.py": 30, "test_checkpoint.py": 28, "test_model.py": 27,
    "test_dataloader.py": 25, "test_structured.py": 20, "test_samples.py": 20, "test_cli.py": 20,
    "test_passkey.py": 15, "test_wikitext.py": 14, "test_layout.py": 10, "test_metrics.py": 10,
    "test_clean_golden.py": 10, "test_config.py": 2,
}

UNKNOWN_TEST_SECONDS = 3.0


def file_cost(name: str, n_tests: int) -> float:
    """The expected seconds of test file ``name`` (a file name, e.g. "test_train.py")."""
    return FILE_SECONDS.get(name, UNKNOWN_TEST_SECONDS * n_tests)


def longest_files_first(items: list) -> None:
    """Reorder ``items`` (pytest's collected tests) in place: files by descending
    :func:`file_cost`, each file's tests in their own order."""
    counts: dict[str, int] = {}
    for it in items:
        name = Path(str(it.path)).name
        counts[name] = counts.get(name, 0) + 1
    items.sort(key=lambda it: -file_cost(Path(str(it.path)).name, counts[Path(str(it.path)).name]))
