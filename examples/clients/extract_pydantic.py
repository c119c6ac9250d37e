#!/usr/bin/env python
"""Extract a pydantic object from free text with the openai SDK's chat.completions.parse.

The server enforces the model's JSON schema token by token (response_format json_schema), so
the reply always parses. Start a server first (`make serve`), then:

    python examples/clients/extract_pydantic.py [--base-url http://127.0.0.1:8000/v1] [--json]
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI
from pydantic import BaseModel, Field

TEXT = ("Marie Curie was a physicist and chemist, born in Warsaw in 1867. She moved to Paris, "
        "where she won the Nobel Prize twice.")


class Person(BaseModel):
    name: str = Field(max_length=40)
    birth_year: int = Field(ge=1000, le=2100)
    birth_city: str = Field(max_length=40)
    professions: list[str] = Field(max_length=3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="not-needed")
    ap.add_argument("--json", action="store_true", help="print the object as JSON")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    r = client.chat.completions.parse(
        model=model, response_format=Person, temperature=0, max_tokens=200,
        messages=[{"role": "system", "content": "Extract the person described by the user as JSON."},
                  {"role": "user", "content": TEXT}])
    person = r.choices[0].message.parsed
    print(json.dumps(person.model_dump()) if args.json else repr(person))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
