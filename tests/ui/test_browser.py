"""The page in headless chromium against a real server: chat streams in, the dashboard moves, the key works.

The last test serves the default model (configs/default.yaml, fetched by `make test`) and keeps
screenshots of a wide and a narrow window in the test output (LLMSERVE_UPDATE_DOCS=1: in docs/img too).
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest

from tests.server.conftest import FAKE, start_default_server, start_server
from tests.ui.conftest import OUTPUT, ROOT, frames

# a fake step of 30 ms: a 40-token answer streams for over a second, long enough to watch it arrive
SLOW_FAKE = FAKE | {"backend": {"name": "fake", "options": {"step_cost_s": 0.03}}}


@pytest.fixture(scope="module")
def slow_server():
    s = start_server(SLOW_FAKE)
    yield s
    s.stop()


FRAMES = "() => Number(document.querySelector('#dash-note').dataset.frames || 0) >= {}"  # dashboard frames shown


def finished(page) -> int:
    return int(page.inner_text("#d-finished").split()[0])


def test_a_chat_streams_in_and_the_dashboard_counts_it(page, slow_server):
    page.goto(slow_server.url + "/")
    page.wait_for_function(FRAMES.format(1))
    assert page.input_value("#model") == "embedded"  # from /v1/models
    before = finished(page)
    page.fill("#max-tokens", "40")
    page.fill("#input", "Hello")
    page.press("#input", "Enter")
    # the reply grows token by token while it streams: sample its length until it is done
    lengths = []
    page.wait_for_selector(".msg.assistant.streaming")
    while page.locator(".msg.assistant.streaming").count():
        lengths.append(page.locator(".msg.assistant .tok").count())
        page.wait_for_timeout(60)
    assert len({n for n in lengths if 0 < n < 40}) >= 3, lengths  # seen part-way, several times
    assert page.inner_text(".msg.user") == "Hello"
    assert page.evaluate("ui.messages.map((m) => m.role)") == ["user", "assistant"]  # the next turn sends both
    meta = page.inner_text(".msg.assistant .meta")
    assert meta.startswith("40 tokens") and meta.endswith("length"), meta
    # the dashboard: the request is counted, its tokens are in the total and its latencies in the table
    page.wait_for_function(f"() => parseInt(document.querySelector('#d-finished').textContent) > {before}", timeout=5000)
    assert int(page.inner_text("#d-tps-sub").split()[0]) >= 40
    assert page.inner_text("#ttft-p50").endswith("ms") and page.inner_text("#itl-p50").endswith("ms")
    assert page.get_attribute("#live-dot", "class") == "dot live"
    # the token view: each token has its alternatives on hover
    page.hover(".msg.assistant .tok >> nth=2")
    assert page.is_visible("#tip") and page.locator("#tip tr").count() == 5
    assert page.locator("#tip tr.chosen").count() >= 1
    assert not page.problems, page.problems


def test_a_streamed_count_moves_the_live_tiles_while_it_runs(page, slow_server):
    page.goto(slow_server.url + "/")
    page.wait_for_function(FRAMES.format(2))
    page.fill("#max-tokens", "120")  # ~4 s of decoding
    page.fill("#input", "count")
    page.press("#input", "Enter")
    page.wait_for_function("() => document.querySelector('#d-running').textContent === '1'", timeout=5000)
    page.wait_for_function("() => parseFloat(document.querySelector('#d-tps').textContent) > 5", timeout=5000)
    page.click("#stop-btn")  # Stop aborts the stream; the engine frees the sequence
    page.wait_for_function("() => document.querySelector('#d-running').textContent === '0'", timeout=5000)
    assert page.inner_text(".msg.assistant .meta").endswith("stopped")
    page.click("#clear")
    assert page.locator(".msg").count() == 0 and page.evaluate("ui.messages.length") == 0
    assert not page.problems, page.problems


def test_completion_mode_with_a_json_schema(page, fake_server):
    page.goto(fake_server.url + "/")
    page.click("#mode-completion")
    page.uncheck("#logprobs")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    page.fill("#schema", json.dumps(schema))
    page.fill("#input", "A JSON object:")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.completion .meta:not(:empty)")
    assert page.inner_text(".msg.completion .prompt") == "A JSON object:"
    out = json.loads(page.inner_text(".msg.completion .body"))
    assert isinstance(out["n"], int)
    page.fill("#schema", "{not json")
    page.press("#input", "Enter")
    assert "not valid JSON" in page.inner_text("#schema-error")
    assert not page.problems, page.problems


def test_the_sampling_fields_say_what_an_empty_one_samples_with(page):
    s = start_server(FAKE | {"backend": {"name": "fake", "options": {"generation_defaults": {"temperature": 0.2}}}})
    try:
        page.goto(s.url + "/")
        page.wait_for_function("() => document.querySelector('#temperature').placeholder.startsWith('0.2')")
        assert page.get_attribute("#temperature", "placeholder") == "0.2 (model's default)"
        assert page.get_attribute("#temperature", "title") == ("left empty: 0.2, from "
                                                               "backend.options.generation_defaults")
        assert page.get_attribute("#top-p", "placeholder") == "1 (model's default)"  # the API's, the model sets none
        page.screenshot(path=str(OUTPUT / "ui-sampling-defaults.png"))
        assert not page.problems, page.problems
    finally:
        s.stop()


def test_the_api_key_is_typed_into_the_page_and_kept_in_the_browser(page):
    s = start_server(FAKE | {"server": {"api_key": "sesame"}})
    try:
        page.goto(s.url + "/")
        page.wait_for_selector(".key.needed")  # /v1/models said 401: the field asks for the key
        page.fill("#input", "hi")
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.assistant.error")
        assert "401" in page.inner_text(".msg.assistant.error")
        page.fill("#api-key", "sesame")
        page.wait_for_function("() => !document.querySelector('.key').classList.contains('needed')")
        page.fill("#input", "hi again")
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.assistant:not(.error) .meta:not(:empty)")
        page.reload()
        assert page.input_value("#api-key") == "sesame"  # kept in localStorage, not in the page's URL or a cookie
        assert page.evaluate("localStorage.getItem('llmserve.apiKey')") == "sesame"
        assert page.context.cookies() == []
    finally:
        s.stop()


def background_load(server, n: int) -> list[threading.Thread]:
    """n concurrent streamed completions of 96 tokens each, running in threads."""
    client = server.client(timeout=120)

    def one(i):
        for _ in client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"List {i} animals:", max_tokens=96,
                                           stream=True, extra_body={"ignore_eos": True}):
            pass

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.fixture(scope="module")
def default_server():
    s = start_default_server()
    yield s
    s.stop()


def test_a_stop_string_stays_out_of_the_answer_and_is_dimmed_in_the_token_view(page, default_server):
    page.goto(default_server.url + "/")
    page.click("#mode-completion")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "40")
    page.fill("#stop", ",")
    page.fill("#input", "The three largest cities in France are")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.completion .meta:not(:empty)", timeout=120_000)
    assert page.inner_text(".msg.completion .meta").endswith("stop")
    shown = page.locator(".msg.completion .tok:not(.extra)").all_inner_texts()
    dimmed = page.locator(".msg.completion .tok.extra").all_inner_texts()
    assert "Paris" in "".join(shown) and "," not in "".join(shown)
    assert dimmed and "," in dimmed[0]
    assert not page.problems, page.problems


def test_screenshots_of_the_default_model(browser, default_server):
    s = default_server
    OUTPUT.mkdir(parents=True, exist_ok=True)
    shots = {}
    for name, size in (("wide", (1280, 800)), ("narrow", (390, 844))):
        ctx = browser.new_context(viewport={"width": size[0], "height": size[1]}, device_scale_factor=1)
        pg = ctx.new_page()
        pg.goto(s.url + "/")
        pg.wait_for_function(FRAMES.format(1))
        if name == "narrow":
            pg.click(".params summary")  # folded on a phone; shown here for the picture
        pg.fill("#temperature", "0")
        pg.fill("#max-tokens", "64")
        for i, q in enumerate(("What is the capital of France?", "Tell me one fact about it.")):
            pg.fill("#input", q)
            pg.press("#input", "Enter")
            pg.wait_for_selector(f".msg.assistant >> nth={i}")
            pg.wait_for_selector(".msg.assistant.streaming", state="detached", timeout=120_000)
        assert "Paris" in pg.inner_text(".msg.assistant >> nth=0")
        load = background_load(s, 12)  # so the dashboard has a batch, a queue and a curve to show
        pg.wait_for_function("() => Number(document.querySelector('#d-running').textContent) > 1",
                             timeout=60_000)
        if name == "wide":  # a frame of the feed under the same load, for docs/ui.md
            (OUTPUT / "stats-frame.json").write_text(json.dumps(frames(s.url, 2, interval=0.5)[-1]))
        pg.wait_for_timeout(2500)
        pg.hover(".msg.assistant >> nth=0 >> .tok >> nth=5")
        path = OUTPUT / f"ui-{name}.png"
        pg.screenshot(path=str(path), full_page=name == "narrow")
        shots[name] = path
        for t in load:
            t.join(120)
        ctx.close()
    assert all(p.stat().st_size > 20_000 for p in shots.values())
    if os.environ.get("LLMSERVE_UPDATE_DOCS") == "1":
        for name, path in shots.items():
            shutil.copyfile(path, ROOT / "docs" / "img" / path.name)
