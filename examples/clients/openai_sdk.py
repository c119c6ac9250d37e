#!/usr/bin/env python3
"""Talk to a running llmserve with the official OpenAI Python SDK: completions, chat, streaming.

Start a server first, e.g. one that needs no model files:

    llmserve --config configs/example-plugin.yaml          # or: llmserve --config configs/default.yaml

then:

    python examples/clients/openai_sdk.py
    python examples/clients/openai_sdk.py --base-url http://127.0.0.1:8000/v1 --api-key $LLMSERVE_API_KEY

The API key only matters when the server sets server.api_key (or LLMSERVE_API_KEY).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Run a completion, a chat completion, and both streamed; print what came back."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    ap.add_argument("--api-key", default=os.environ.get("LLMSERVE_API_KEY", "not-needed"))
    ap.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    try:
        from openai import APIConnectionError, APIStatusError, OpenAI
    except ImportError:
        print("this example needs the OpenAI SDK: pip install openai", file=sys.stderr)
        return 2

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=60.0, max_retries=0)
    try:
        model = args.model or client.models.list().data[0].id
        print(f"model: {model}")

        # 1. a plain completion
        c = client.completions.create(model=model, prompt="The capital of France is",
                                      max_tokens=args.max_tokens, temperature=0)
        print(f"\ncompletion ({c.choices[0].finish_reason}, {c.usage.completion_tokens} tokens):")
        print(repr(c.choices[0].text))

        # 2. a chat completion
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": "Name three prime numbers."}],
            max_tokens=args.max_tokens, temperature=0.7, seed=1,
        )
        print(f"\nchat ({chat.choices[0].finish_reason}):")
        print(repr(chat.choices[0].message.content))

        # 3. streaming: text arrives as server-sent events, one delta per chunk
        print("\nstreamed completion:")
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=args.max_tokens,
                                           temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].text, end="", flush=True)
        print()

        print("\nstreamed chat (with usage in the last chunk):")
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=args.max_tokens,
            stream=True, stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.usage is not None:
                usage = chunk.usage
        print()
        if usage is not None:
            print(f"usage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens")
    except APIConnectionError:
        print(f"cannot reach {args.base_url}: is `llmserve` running?", file=sys.stderr)
        return 1
    except APIStatusError as e:  # the server answered with an OpenAI-shaped error body
        print(f"server error {e.status_code}: {e.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
