"""Tools reach the model's chat template as transformers passes them: the tool definitions as
`tools`, earlier calls as `tool_calls` with dict arguments, results with their `tool_call_id`."""

from __future__ import annotations

import json

from strata.protocol.chat_template import compile_chat_template, render_chat
from strata.protocol.openai import ChatCompletionRequest
from strata.server.tools import tool_plan
from strata.server.translate import chat_messages

# The shape of Qwen2.5's template, cut down to what tool calling needs.
TEMPLATE = """{%- if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}\
{% endfor %}</tools>
{% endif %}{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}
{%- for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", "arguments": \
{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}
{%- if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}
{% endfor %}"""


def test_tools_calls_and_results_are_rendered() -> None:
    req = ChatCompletionRequest.model_validate({
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object"}}}]})
    plan = tool_plan(req)
    text = render_chat(compile_chat_template(TEMPLATE, "test"), chat_messages(req.messages),
                       add_generation_prompt=True, bos_token=None, eos_token=None,
                       tools=plan.template_tools)
    tool = json.dumps({"name": "get_weather", "parameters": {"type": "object"}})
    assert text == (f"<tools>{tool}</tools>\n<|user|>Weather?<|assistant|><tool_call>"
                    '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
                    "<|tool|>12 C[call_1]")
