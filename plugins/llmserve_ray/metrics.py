"""The fleet's /metrics: each replica's Prometheus text, merged family by family with a replica label."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def merge_replica_metrics(texts: dict[str, str]) -> str:
    """One exposition: each family's HELP/TYPE once, then its samples from every replica, labelled replica="id"."""
    families: dict[str, list[str]] = {}  # family → its HELP/TYPE lines, then samples; insertion order kept
    for replica, text in sorted(texts.items()):
        family = None
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    lines = families.setdefault(family, [])
                    if not any(x.startswith(f"# {parts[1]} ") for x in lines):
                        lines.append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, rest = m.groups()
            label = f'replica="{replica}"'
            labels = "{" + label + ("," + labels[1:] if labels and labels != "{}" else "}")
            families.setdefault(family or name, []).append(f"{name}{labels}{rest}")
    return "".join(line + "\n" for lines in families.values() for line in lines)
