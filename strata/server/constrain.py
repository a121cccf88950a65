"""What constrains a request's choices: its structured output (structured.py) or its forced tool
calls (tools.py), never both; one fresh constraint per choice (None: unconstrained)."""

from __future__ import annotations

from strata.engine.constraint import TokenConstraint
from strata.errors import InvalidRequestError
from strata.protocol.openai import ChatCompletionRequest, CompletionRequest
from strata.server.structured import GrammarService, grammar_spec
from strata.server.tools import ToolPlan, tool_plan


async def plan_choices(grammar: GrammarService, req: CompletionRequest | ChatCompletionRequest,
                       n: int) -> tuple[ToolPlan, list[TokenConstraint | None]]:
    """The tool plan (chat only) and one constraint per choice."""
    tools = tool_plan(req) if isinstance(req, ChatCompletionRequest) else ToolPlan()
    spec = grammar_spec(req)
    if tools.spec is not None and spec is not None:
        raise InvalidRequestError(f"{spec.param}: a forced tool call (tool_choice) and "
                                  "structured output cannot be combined", param=spec.param)
    spec = tools.spec or spec
    if spec is None:
        return tools, [None] * n
    return tools, list(await grammar.constraints(spec, n))


__all__ = ["plan_choices"]
