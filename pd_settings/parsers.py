"""GLM's output parsers, by vLLM's names (``--tool-call-parser``, ``--reasoning-parser``): the
decode servers' and, for the grammar of a chat's first token, vLLM's prefill's."""

from typing import Literal

ToolCallParser = Literal["none", "glm45", "glm47"]
ReasoningParser = Literal["none", "glm45", "glm47"]
