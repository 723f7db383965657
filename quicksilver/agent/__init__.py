"""A tool-using agent over the OpenAI chat API: the loop and its tools (search, calculator, files, Python)."""

from quicksilver.agent.loop import AgentResult, AgentStep, format_step, run_agent
from quicksilver.agent.tools import TOOL_NAMES, Tool, ToolError, build_tools

__all__ = ["TOOL_NAMES", "AgentResult", "AgentStep", "Tool", "ToolError", "build_tools", "format_step", "run_agent"]
