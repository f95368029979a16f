"""What the perf scripts print about the machine they ran on (no side effects on import)."""
from __future__ import annotations

from utils.environment import cpu_model  # noqa: F401  (the one reader of /proc/cpuinfo)
