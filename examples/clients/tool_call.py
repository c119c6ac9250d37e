#!/usr/bin/env python
"""A two-turn tool call with the openai SDK: the model calls a function, we run it, the model answers.

The first turn names the function (`tool_choice`), so the server's grammar makes the arguments
valid JSON for its parameters schema, whatever the model; the second turn hands back the tool
result and asks for the answer in words. Start a server first (`make serve`), then:

    python examples/clients/tool_call.py [--base-url http://127.0.0.1:8000/v1] [--json]
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40, "description": "the city's name"}}}}}]


def get_weather(city: str) -> dict:
    """The tool itself (a stand-in: a real one would call a weather service)."""
    return {"city": city, "temperature_c": 21, "sky": "sunny"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="not-needed")
    ap.add_argument("--json", action="store_true", help="print the call, the result and the answer as JSON")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]

    # turn 1: the model calls get_weather (the grammar makes the arguments match its schema)
    first = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    result = get_weather(**json.loads(call.function.arguments))

    # turn 2: the call and its result go back; the model answers in words
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=60)
    answer = second.choices[0].message.content
    if args.json:
        print(json.dumps({"call": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
                          "result": result, "answer": answer}))
    else:
        print(f"call:   {call.function.name}({call.function.arguments})\nresult: {result}\nanswer: {answer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
