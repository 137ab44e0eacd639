"""The calculator tool's arithmetic: an expression of numbers, + - * / // % **, unary signs and parentheses.

Numbers are written as in Python, and integers may also be zero-padded ("02322" is 2322).

The expression is parsed with Python's `ast` and only those nodes are evaluated: no names,
calls or attributes, so no text reaches `eval`. Integers are exact (Python ints); a power
whose result would exceed `MAX_DIGITS` digits is refused before it is computed. The tool
still runs in the sandbox, under its CPU and memory limits, like any other.
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_DIGITS = 4000  # the largest integer result; keeps a power from eating the CPU budget silently
MAX_LENGTH = 1000  # characters of an expression

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Zeros that pad an integer ("02322", as zero-padded problems write operands): Python's grammar refuses them.
_PADDING_ZEROS = re.compile(r"(?<![\d.])0+(?=\d)")


class CalculatorError(ValueError):
    """An expression the calculator does not accept; the message is what the model reads."""


def evaluate(expression: str) -> int | float:
    """The value of `expression`; CalculatorError for anything that is not plain arithmetic."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression must be a non-empty string")
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(_PADDING_ZEROS.sub("", expression.strip()), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(result, complex):
            raise CalculatorError("the result is not a real number")
        return result
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed (got {ast.unparse(node)!r})")


def _check_power(base: int | float, exponent: int | float) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log10(abs(base)) > MAX_DIGITS:
            raise CalculatorError(f"the result would have more than {MAX_DIGITS} digits")


def format_value(value: int | float) -> str:
    """Integers exactly; floats with up to 12 significant digits (an integral float without its '.0')."""
    if isinstance(value, int):
        return str(value)
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"
