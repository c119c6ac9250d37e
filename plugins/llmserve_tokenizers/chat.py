"""Chat templates rendered the way transformers renders them (its chat_template_utils, v5), over jinja2 alone, and
the request rules every template tokenizer shares: a missing template, renderer arguments, template errors → 400."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from llmserve.errors import InvalidRequestError

# names the renderer passes itself, besides apply_chat_template's parameters: a chat_template_kwargs key among them
# would be a second value for one argument (a TypeError inside transformers)
RENDER_NAMES = frozenset({"messages", "conversations", "tools", "documents", "add_generation_prompt"})
# a message's reasoning, under the names templates read it (the first is the standard one)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def apply(name: str, template: Any, reserved: Iterable[str], kwargs: Mapping[str, Any],
          render: Callable[[], str]) -> str:
    """render()'s prompt; a 400 when there is no template, kwargs set a renderer argument, or rendering fails."""
    if not template:
        raise InvalidRequestError(
            f"the tokenizer {name!r} has no chat template; use /v1/completions, a checkpoint whose "
            "tokenizer_config.json defines chat_template, or start the server with --chat-template FILE",
            param="messages")
    for k in kwargs.keys() & (RENDER_NAMES | set(reserved)):
        raise InvalidRequestError(f"chat_template_kwargs may not set {k!r} (an argument of the renderer; "
                                  "use the request field, if there is one)", param=f"chat_template_kwargs.{k}")
    from jinja2 import TemplateError

    try:
        return render()
    # the template's raise_exception, no final message to continue, or a template's operation on the request's values
    except (TemplateError, ValueError, TypeError) as e:
        raise InvalidRequestError(f"the chat template could not render these messages: {e}",
                                  param="messages") from None


def joined(template: str | dict[str, str] | None) -> str | None:
    """The template's text; a checkpoint naming several templates (a dict) gives them all, for tool parser auto."""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def render(template: str | dict[str, str], messages: list[dict[str, Any]], special_tokens: Mapping[str, str],
           kwargs: Mapping[str, Any], tools: list[dict] | None = None, add_generation_prompt: bool = False,
           continue_final_message: bool | str = False) -> str:
    """The prompt transformers' apply_chat_template(messages, tokenize=False, ..., **kwargs) gives for a tokenizer
    with this template and special tokens map (ValueError / TypeError / jinja2's TemplateError where it raises)."""
    template = _pick(template, tools)
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    for tool in tools or ():
        if not isinstance(tool, dict):
            raise ValueError("Tools should be JSON schemas (objects)")
    for m in messages:
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be objects, but got {m!r}.")
    # keys whose value is None are dropped (a null content renders as a missing key, not as "None")
    chat = [_alias_reasoning(m) for m in _plain([{k: v for k, v in m.items() if v is not None} for m in messages])]
    final = None
    if continue_final_message:
        final = _tag_final(chat, template, continue_final_message)
    rendered = _compiled(template).render(messages=chat, tools=_plain(tools), documents=None,
                                          add_generation_prompt=add_generation_prompt,
                                          **_plain({**special_tokens, **kwargs}))
    return rendered if final is None else _cut_at_tag(rendered, final)


def _pick(template: str | dict[str, str], tools) -> str:
    """One of several named templates: "tool_use" when there are tools, else "default" (as transformers picks)."""
    if not isinstance(template, dict):
        return template
    if tools is not None and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise ValueError("This model has multiple chat templates with no default specified! Available template names "
                     f"are {sorted(template)}.")


def _plain(value: Any) -> Any:
    """A fresh copy built of JSON types only (the template may not reach any object's methods; edits stay ours)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    """reasoning_content filled from its older names, and `thinking` (which gpt-oss templates read) from it."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final(chat: list[dict], template: str, field: bool | str) -> str:
    """Mark the end of the final message's text (its `field`, content by default) so the render can be cut there;
    returns that text."""
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning is copied under several names: tag each copy
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                         "chat_template")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):  # the last text block
            if "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message is set but we could not find any text to continue in the final "
                         "message!")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    """The render up to where the final message's text ends (the template's own end of message dropped)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template! This can happen if the chat template deletes portions of the "
                         f"final message. Final message to continue: {final.strip()}")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """The template compiled in transformers' sandbox: trim_blocks, lstrip_blocks, loop controls, its tojson,
    raise_exception, strftime_now, a safe dict() and namespace(), and {% generation %} blocks (rendered as is)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: marks the assistant's text for training masks; renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's own filter: that one escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):  # noqa: A002 (the name templates call it with)
        return datetime.now().strftime(format)

    class TemplateDict:
        """dict() and dict.fromkeys() without the class itself (no attribute access to break out through)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """namespace() refusing underscore names (no reaching CPython internals through it)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]  # jinja's own signature trick: namespace(self=...) works
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)
