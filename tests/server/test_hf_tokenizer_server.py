"""The server with an HF tokenizer from a local directory: its chat template renders the messages."""

from __future__ import annotations

import openai
import pytest
from llmserve_fake import next_token

from tests.server.conftest import start_server

# SentencePiece-style word pieces ("▁" marks a leading space), so decoding is well defined
WORDS = ["hello", "world", "user", "assistant", ":", "system"]
VOCAB = {"<unk>": 0, "<eos>": 1, **{"\u2581" + w: i + 2 for i, w in enumerate(WORDS)}}


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    # "<unk>" stays an ordinary token: the fake model emits every id, and a skipped special token
    # in the middle of the text would make the streamed spacing a detokenizer question
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", clean_up_tokenization_spaces=False)
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant :{% endif %}")
    d = tmp_path_factory.mktemp("hf_tok")
    fast.save_pretrained(d)
    s = start_server({"model": {"model": str(d), "served_model_name": "tiny-hf"}, "tokenizer": {"name": "hf"},
                      "backend": {"name": "fake", "options": {"vocab_size": len(VOCAB), "eos_token_id": 1}},
                      "cache": {"num_blocks": 64}})
    yield s
    s.stop()


def _continuation(ids: list[int], max_tokens: int) -> list[int]:
    ids, out = list(ids), []
    for _ in range(max_tokens):
        t = next_token(ids, len(ids), len(VOCAB), 1)
        ids.append(t)
        out.append(t)
        if t == 1:
            break
    return out


def test_chat_is_rendered_with_the_checkpoint_template(hf_server):
    client = hf_server.client()
    r = client.chat.completions.create(model="tiny-hf", messages=[{"role": "user", "content": "hello world"}],
                                       max_tokens=6)
    prompt_ids = [4, 6, 2, 3, 5, 6]  # "user : hello world assistant :"
    assert r.usage.prompt_tokens == len(prompt_ids)
    expected = _continuation(prompt_ids, 6)
    tok = hf_server.engine.tokenizer
    # the text the output adds after the prompt (a streamed word keeps its leading space)
    assert r.choices[0].message.content == tok.decode(prompt_ids + expected)[len(tok.decode(prompt_ids)):]
    assert r.choices[0].finish_reason == ("stop" if expected[-1] == 1 else "length")


def test_completion_text_and_logprob_tokens_come_from_the_hf_vocabulary(hf_server):
    r = hf_server.client().completions.create(model="tiny-hf", prompt="hello world", max_tokens=4, logprobs=1,
                                              echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert [t.strip() for t in lp.tokens[:2]] == ["hello", "world"]
    assert {t.strip() for t in lp.tokens} <= set(WORDS) | {"<eos>", "<unk>"}
    with pytest.raises(openai.NotFoundError):
        hf_server.client().completions.create(model="embedded", prompt="hello", max_tokens=1)
