"""RL on verifiable rewards: tasks with verifiers (tasks.py) and GRPO's rollouts, group-relative
advantages and policy-gradient loss (grpo.py), used by the ``rl`` stage (rl.py)."""
