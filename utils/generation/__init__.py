"""Generation: the one engine that turns a model and prompts into tokens (engine.py).

infer (the terminal UI), the trainer's and SFT's samples and benchmark's generation tasks use
it; serving extends it (loop.py runs engines on one thread, remote.py in another process).
Beside the engine: the CPU decode weights (pack.py) over the CPU products (cpu.py), the thread
policy of a step (threads.py), and incremental detokenization (detok.py). The network itself
(model.py) knows nothing of caches or sampling beyond a layer's one-token ``decode`` step.
"""
