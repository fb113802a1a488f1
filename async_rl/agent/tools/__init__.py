"""Tools agent loops can call: the contract (`base`) and the built-ins it registers."""

from async_rl.agent.tools import calculator, python_sandbox  # noqa: F401  (register "calculator", "python")
from async_rl.agent.tools.base import TOOLS, BaseTool, ToolResult, build_tool, load_tools, register_tool

__all__ = ["TOOLS", "BaseTool", "ToolResult", "build_tool", "load_tools", "register_tool"]
