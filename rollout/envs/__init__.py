"""Ready-made environments for multi-turn episodes: `tools.py` (ToolEnvironment: runs the Python tools a chat model
calls). May import: rollout.base only; an environment is whatever follows `rollout.base.env.Environment`
(tests/test_layout.py checks it).
"""

from .tools import ToolEnvironment

__all__ = ["ToolEnvironment"]
