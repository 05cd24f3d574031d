"""triage-rl: mismatch-aware low-precision RL for LLMs."""
from triage._version import __version__

__all__ = ["__version__"]
