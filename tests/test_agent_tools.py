"""Tool calls and tools: the hermes/qwen call format, the calculator, the tool registry and user tools by path."""

from __future__ import annotations

import json

import pytest

from megarl.agent.calculator import CalculatorError, evaluate, format_value
from megarl.agent.tool_calls import ToolCall
from megarl.agent.tools import schemas, tool_name
from megarl.registry import TOOL_CALL_FORMATS, TOOLS

HERMES = TOOL_CALL_FORMATS.get("hermes").target


def test_qwen_is_the_hermes_format():
    assert TOOL_CALL_FORMATS.get("qwen").target is HERMES


def test_parses_every_call_of_a_turn_in_order_and_keeps_the_text_around_them():
    text = ('I will add. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>\n'
            '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(3)\\"}"}\n</tool_call> done')
    parsed = HERMES.parse(text)
    assert parsed.calls == [ToolCall("calculator", {"expression": "1+2"}), ToolCall("python", {"code": "print(3)"})]
    assert parsed.errors == [] and parsed.has_calls
    assert parsed.content == "I will add. \n done"


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}', "without </tool_call>"),
    ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
    ('<tool_call>["calculator"]</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>', '"arguments" must be a JSON object'),
])
def test_a_malformed_call_is_an_error_not_an_exception(text, reason):
    parsed = HERMES.parse(text)
    assert parsed.calls == [] and len(parsed.errors) == 1 and parsed.has_calls
    assert reason in parsed.errors[0].message


def test_a_turn_without_calls_is_plain_content():
    parsed = HERMES.parse("#### 42")
    assert not parsed.has_calls and parsed.content == "#### 42"


def test_render_then_parse_gives_the_call_back():
    call = ToolCall("calculator", {"expression": "12345*678"})
    assert HERMES.parse(HERMES.render(call)).calls == [call]


@pytest.mark.parametrize("expression, value", [
    ("12345+67890", "80235"), ("123456*654321", str(123456 * 654321)), ("2**100", str(2**100)),
    ("-(3 - 10) // 2", "3"), ("7/2", "3.5"), ("1/3", "0.333333333333"), ("10 % 4", "2"), ("6/3", "2"),
    ("67361+02322", "69683"), ("00000+00", "0"), ("1.05+0.5", "1.55"), ("1e05", "100000"),  # padded operands
])
def test_calculator_is_exact_arithmetic(expression, value):
    assert format_value(evaluate(expression)) == value


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os')", "only numbers"), ("a+1", "only numbers"), ("1/0", "division by zero"),
    ("9**9**9", "more than"), ("", "non-empty"), ("1+", "cannot parse"), ("(-1)**0.5", "not a real number"),
])
def test_calculator_refuses_what_is_not_plain_arithmetic(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)


def test_builtin_tools_have_schemas_for_the_chat_template():
    described = {item["function"]["name"]: item["function"] for item in schemas(["calculator", "python"])}
    assert described["calculator"]["parameters"]["required"] == ["expression"]
    assert described["python"]["parameters"]["required"] == ["code"]
    assert set(TOOLS.names()) >= {"calculator", "python"}


def test_a_user_tool_is_named_by_its_python_path(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(
        "def reverse(text):\n    'Reverse a string.'\n    return text[::-1]\n"
        "reverse.registry_meta = {'parameters': {'type': 'object', 'properties': {'text': {'type': 'string'}}}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = TOOLS.resolve("my_tools:reverse")
    assert entry.target("abc") == "cba" and tool_name("my_tools:reverse") == "reverse"
    assert json.dumps(schemas(["my_tools:reverse"])[0]["function"]["parameters"]).count("text") == 1
    assert schemas(["my_tools:reverse"])[0]["function"]["description"] == "Reverse a string."


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("json:no_such_function", "has no attribute 'no_such_function'"),
    ("nope", "unknown tool 'nope'; known: calculator, python"),
])
def test_a_bad_tool_name_says_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        TOOLS.resolve(spec)
