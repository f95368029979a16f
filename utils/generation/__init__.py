"""Generation: the one engine that turns a model and prompts into tokens (engine.py).

infer (the terminal UI), the trainer's and SFT's samples and benchmark's generation tasks use
it; serving extends it. The network itself (model.py) knows nothing of caches or sampling
beyond a layer's one-token ``decode`` step.
"""
