"""Test doubles for tool calling: a backend that says what the prompt tells it to, a byte-level HF tokenizer with a
Qwen2.5-style chat template (tools, tool calls, tool results), and a tool to call."""

from __future__ import annotations

import time
from pathlib import Path

from llmserve_fake import FakeBackend

from llmserve.batch import ModelOutput
from llmserve.constraints import unpack_bitmask
from llmserve.hookspecs import hookimpl

START, END = "\x01", "\x02"  # the byte tokenizer's ids 1 and 2 mark the text the echo backend answers with


def script(text: str) -> str:
    """A user message that makes the echo backend (byte tokenizer) answer `text`, then EOS."""
    return START + text + END


class EchoBackend(FakeBackend):
    """Answers with the prompt's tokens after the last `start` token up to `end`, or the whole prompt without one.

    Under a grammar it writes only what the grammar allows: once it refuses a scripted token the echo stops, and the
    answer ends as soon as the grammar lets it (meanwhile the highest allowed id: a `}` or `]` closes JSON)."""

    def __init__(self, start: int, end: int, **kw):
        super().__init__(**kw)
        self.start, self.end = start, end

    def execute(self, batch):
        if self.step_cost_s:
            time.sleep(self.step_cost_s)
        allowed = {}
        if batch.token_bitmask is not None:
            rows = unpack_bitmask(batch.token_bitmask, self.vocab_size)
            allowed = {i: rows[k].nonzero().flatten().tolist() for k, i in enumerate(batch.bitmask_rows)}
        sampled = []
        for i, r in enumerate(batch.requests):
            prompt = r.token_ids[:r.num_prompt_tokens]
            said = prompt
            if self.start in prompt:
                said = prompt[len(prompt) - prompt[::-1].index(self.start):]
                said = said[:said.index(self.end)] if self.end in said else said
            n, ok = r.num_output_tokens, allowed.get(i)
            tok = said[n] if n < len(said) else self.eos_token_id
            if ok and (tok not in ok or r.token_ids[r.num_prompt_tokens:] != said[:n]):
                tok = self.eos_token_id if self.eos_token_id in ok else max(ok)
            sampled.append(tok if r.do_sample else None)
        return ModelOutput(sampled)


class EchoPlugin:
    @hookimpl
    def register_backends(self, register):
        def build(config):
            o = {"start": 1, "end": 2, "vocab_size": 257, "eos_token_id": 256, "step_cost_s": 0.0,
                 **config.backend.options}
            return EchoBackend(o["start"], o["end"], vocab_size=o["vocab_size"], eos_token_id=o["eos_token_id"],
                               max_model_len=config.model.max_model_len or 4096, step_cost_s=o["step_cost_s"])

        register("echo", build)


ECHO = {"backend": {"name": "echo"}, "model": {"model": "embedded", "max_model_len": 4096, "served_model_name": "echo"},
        "cache": {"num_blocks": 1024, "block_size": 16}}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc"]}},
                                       "required": ["zone"], "additionalProperties": False}}}

# Qwen2.5's template, trimmed (plus Qwen3's enable_thinking switch, and an error as some templates raise)
QWEN_TEMPLATE = r"""
{%- if messages[0].role == 'developer' %}{{- raise_exception('developer messages are not supported') }}{%- endif %}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\n\n# Tools\n\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nReturn each call as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
""".strip()


def save_byte_tokenizer(path: Path, template: str | None = QWEN_TEMPLATE):
    """A byte-level BPE tokenizer (every byte a token; 260 ids): <|im_end|> (256) is EOS, <|im_start|> 257,
    <tool_call> 258 and </tool_call> 259 are added tokens as in Qwen2.5. Returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    fast.add_tokens(["<tool_call>", "</tool_call>"])
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(path)
    return fast


def start_tiny_qwen(d: Path, server: dict | None = None):
    """A server (served as "tiny-qwen", torch backend) on a tiny random Qwen2 saved in d with the byte tokenizer and
    the Qwen2.5-style tools template; `server` is its server section. Random weights: the grammar makes its calls."""
    from tests.server.conftest import start_server
    from tests.torch.torch_helpers import make_qwen2

    tok = save_byte_tokenizer(d)
    model = make_qwen2(seed=3, vocab_size=len(tok))
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048  # a prompt with tool schemas is ~500-700 byte tokens
    model.save_pretrained(d)
    return start_server({"model": {"model": str(d), "served_model_name": "tiny-qwen"},
                         "backend": {"name": "torch", "kv_cache_memory": "16MiB"}, "cache": {"block_size": 16},
                         "server": server or {}})
