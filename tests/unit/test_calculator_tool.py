"""The calculator tool: arithmetic evaluated from the syntax tree, bad input a tool error, sizes bounded."""

import asyncio
import time

import pytest

from async_rl.agent.tools import TOOLS, build_tool
from async_rl.agent.tools.calculator import CalcError, CalculatorTool, evaluate


def call(tool, arguments):
    return asyncio.run(tool.execute("ep", arguments))


@pytest.mark.parametrize("expression, value", [
    ("2*(3+4)", "14"), ("7/2", "3.5"), ("8/4", "2"), ("-3**2", "-9"), ("(-3)**2", "9"), ("10//3", "3"),
    ("-7 // 2", "-4"), ("10 % 3", "1"), ("2**100", str(2**100)), ("2**-1", "0.5"), (" 1_000 + +1 ", "1001"),
    ("0.1 + 0.2", "0.30000000000000004"), ("2**0.5", repr(2**0.5)),
])
def test_arithmetic(expression, value):
    result = call(CalculatorTool(), {"expression": expression})
    assert not result.error and result.text == value


@pytest.mark.parametrize("expression, why", [
    ("1/0", "division by zero"), ("5 % 0", "division by zero"), ("0**-1", "division by zero"),
    ("abs(-1)", "Call is not allowed"), ("x + 1", "Name is not allowed"), ("(1).real", "Attribute is not allowed"),
    ("__import__('os').system('true')", "not allowed"), ("[1, 2]", "List is not allowed"),
    ("1 << 3", "LShift is not allowed"), ("'a' * 3", "only numbers"), ("True + 1", "only numbers"),
    ("1j * 2", "only numbers"), ("2 +", "not a valid expression"), ("", "non-empty"),
    ("(-8) ** (1/3)", "complex"), ("1e308 * 10", "not a finite number"), ("2.0 ** 5000", "too large"),
    ("10.0 ** 400", "too large"),
])
def test_refused_with_a_reason(expression, why):
    result = call(CalculatorTool(), {"expression": expression})
    assert result.error and why in result.text, result.text


def test_sizes_are_bounded_before_computing():
    # refused up front, not computed: (10**3000)**(10**3000) computed would not end (pytest's timeout would say so)
    for expression in ("9**9**9", "2**10**8", "(10**3000)**(10**3000)", "99999**9999*99999**9999"):
        result = call(CalculatorTool(), {"expression": expression})
        assert result.error and "too large" in result.text, (expression, result.text)
    long = "+".join(["1"] * 150)
    assert "too long" in call(CalculatorTool(), {"expression": long}).text
    assert call(CalculatorTool(max_chars=400), {"expression": long}).text == "150"
    deep = "(" * 120 + "1" + ")" * 120
    assert call(CalculatorTool(max_chars=400), {"expression": deep}).text == "1"


def test_bad_arguments_are_tool_errors():
    tool = CalculatorTool()
    for arguments in ({}, {"expr": "1+1"}, {"expression": 3}, {"expression": None}):
        result = call(tool, arguments)
        assert result.error and "expression" in result.text
    with pytest.raises(CalcError, match="non-empty string"):
        evaluate(42)  # type: ignore[arg-type]


def test_registered_and_configured_by_name():
    assert TOOLS["calculator"] is CalculatorTool
    tool = build_tool({"name": "calculator", "config": {"max_exponent": 10}})
    assert call(tool, {"expression": "2**10"}).text == "1024"
    assert "max_exponent=10" in call(tool, {"expression": "2**11"}).text
    assert tool.schema["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="max_chars"):
        build_tool({"name": "calculator", "config": {"max_chars": 0}})
    with pytest.raises(ValueError, match="digits"):
        build_tool({"name": "calculator", "config": {"digits": 3}})
