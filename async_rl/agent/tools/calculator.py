"""The `calculator` tool: exact arithmetic on one expression, evaluated from its syntax tree.

Only numbers, `+ - * / // % **`, unary signs and parentheses are accepted: no names, calls
or attributes, so nothing but arithmetic can run. Sizes are bounded before they are
computed (expression length, exponent, digits of an integer), so `9**9**9` is refused at
once instead of hanging the event loop.

    tools:
      - name: calculator
        config: {max_chars: 200, max_exponent: 10000, max_int_bits: 10000}
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from async_rl.agent.tools.base import BaseTool, ToolResult, register_tool

Number = int | float

BINARY_OPS: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
UNARY_OPS: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalcError(ValueError):
    """An expression the calculator will not evaluate; the message says why."""


@dataclass(kw_only=True)
class CalculatorConfig:
    """Bounds of the `calculator` tool (its YAML `config:` map)."""

    max_chars: int = 200  # longest expression accepted
    max_exponent: int = 10_000  # largest |exponent| of `**`
    max_int_bits: int = 10_000  # largest integer (about 3,000 digits) an expression may produce

    def __post_init__(self) -> None:
        for key in ("max_chars", "max_exponent", "max_int_bits"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"calculator config: {key} must be a positive integer, got {value!r}")


def _power(base: Number, exp: Number, cfg: CalculatorConfig) -> Number:
    if abs(exp) > cfg.max_exponent:
        raise CalcError(f"exponent {exp} is too large (max_exponent={cfg.max_exponent})")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exp > cfg.max_int_bits:
            raise CalcError(f"result of {base}**{exp} would be too large (max_int_bits={cfg.max_int_bits})")
    if base == 0 and exp < 0:
        raise CalcError("division by zero (0 raised to a negative power)")
    return base ** exp


def _evaluate(node: ast.AST, cfg: CalculatorConfig) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, cfg)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalcError(f"only numbers are allowed, got {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPS:
        return UNARY_OPS[type(node.op)](_evaluate(node.operand, cfg))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPS:
        left, right = _evaluate(node.left, cfg), _evaluate(node.right, cfg)
        if isinstance(node.op, ast.Pow):
            result = _power(left, right, cfg)
        elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        else:
            result = BINARY_OPS[type(node.op)](left, right)
        if isinstance(result, int) and result.bit_length() > cfg.max_int_bits:
            raise CalcError(f"intermediate result is too large (max_int_bits={cfg.max_int_bits})")
        return result
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise CalcError(f"{what} is not allowed (only numbers, + - * / // % ** and parentheses)")


def evaluate(expression: str, cfg: CalculatorConfig | None = None) -> Number:
    """The value of an arithmetic expression; `CalcError` says why when there is none."""
    cfg = cfg or CalculatorConfig()
    if not isinstance(expression, str) or not expression.strip():
        raise CalcError("expression must be a non-empty string")
    if len(expression) > cfg.max_chars:
        raise CalcError(f"expression is too long ({len(expression)} characters; max_chars={cfg.max_chars})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalcError(f"not a valid expression: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CalcError("expression is nested too deeply or has a too long number") from None
    try:
        result = _evaluate(tree, cfg)
    except OverflowError:
        raise CalcError("the result is too large (overflow)") from None
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except RecursionError:
        raise CalcError("expression is nested too deeply") from None
    if isinstance(result, complex):
        raise CalcError("the result is a complex number (e.g. a fractional power of a negative number)")
    if isinstance(result, float) and not math.isfinite(result):
        raise CalcError("the result is not a finite number")
    return result


def format_number(value: Number) -> str:
    """Integers exactly; floats shortest-round-trip, with whole floats shown as integers."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


@register_tool("calculator")
class CalculatorTool(BaseTool):
    """Evaluates one arithmetic expression exactly (integers have unbounded precision)."""

    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. 2*(3+4)."
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "the expression, e.g. (17-5)/4"}},
                  "required": ["expression"]}

    def __init__(self, **config: Any):
        super().__init__(**config)
        self.cfg = CalculatorConfig(**config)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        expression = arguments.get("expression") if isinstance(arguments, dict) else None
        if expression is None:
            return ToolResult(error=True, text="calculator: missing the `expression` argument (a string)")
        try:
            return ToolResult(text=format_number(evaluate(expression, self.cfg)))
        except CalcError as exc:
            return ToolResult(error=True, text=f"calculator: {exc}")
        except ValueError:  # str() of an int beyond sys.get_int_max_str_digits()
            return ToolResult(error=True, text="calculator: the result has too many digits to print")
