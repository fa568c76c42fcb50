"""A harness built on the OpenAI Agents SDK with its default (Responses) model: one tool loop.
Run as `ledger run -- python agents_tool_loop.py TOOL_CALL_JSON ANSWER_JSON`; it reaches the
gateway through OPENAI_BASE_URL only. The extra_body constraint steers the tiny random model."""

import json
import sys

from agents import Agent, ModelSettings, Runner, function_tool

TOOL_CALL, ANSWER = json.loads(sys.argv[1]), json.loads(sys.argv[2])


@function_tool
def read(path: str, n: int) -> str:
    """Read a file."""
    agent.model_settings = ModelSettings(max_tokens=80, extra_body={"constraint": ANSWER, "seed": 2})
    return f"{n} lines of {path}"


agent = Agent(name="coder", instructions="You are a coding agent.", tools=[read], model="tiny",
              model_settings=ModelSettings(max_tokens=80, extra_body={"constraint": TOOL_CALL, "seed": 1}))
result = Runner.run_sync(agent, "Fix x.py.")
print(result.final_output)
