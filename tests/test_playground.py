"""The playground at GET /, in headless Chromium (Debian's `chromium`, driven by Playwright), against
`python run_server.py` on the default model with --api-key: what a person sees and can do, each
checked against the API's own answer to the same request."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import httpx
import pytest
from server import free_port

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "docs" / "playground.png"
KEY = "playground-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# test_gguf's default-model server flags: the compiled steps are shared through the executable cache
FLAGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
QUESTION = "Write one sentence about the sea."


def chromium() -> str:
    """The system browser. In CI a missing browser is a failure (.ci/run installs it), elsewhere a skip."""
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "no Chromium: install Debian's `chromium` (apt-get install chromium), as .ci/run does"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "run_server.py", "--port", str(port), "--api-key", KEY, *FLAGS],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the server did not become healthy"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    path = chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path)
        yield b
        b.close()


class Page:
    """A fresh tab (its own storage) on the playground, with its console errors collected. Playwright's
    waits for a condition evaluate strings, which the page's Content-Security-Policy forbids: `bypass_csp`
    lifts it for the tests that use them (the first test loads the page under it)."""

    def __init__(self, browser, url: str, key: str | None = KEY, bypass_csp: bool = True):
        self.context = browser.new_context(viewport={"width": 1280, "height": 800}, bypass_csp=bypass_csp)
        if key:
            self.context.add_init_script(f"sessionStorage.setItem('jaxserve.apiKey', {json.dumps(key)})")
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.url = url
        self.page.goto(url + "/")

    def __getattr__(self, name):
        return getattr(self.page, name)

    def id(self, testid: str):
        return self.page.get_by_test_id(testid)

    def connected(self):
        self.page.locator("#model-name", has_text="smollm2-135m-instruct").wait_for()

    def settings(self, **values):
        self.page.locator("#settings details").evaluate("d => { d.open = true; }")  # (llama.cpp's samplers)
        for name, value in values.items():
            field = self.id("setting-" + name.replace("_", "-"))
            if isinstance(value, bool):
                field.set_checked(value)
            else:
                field.fill(str(value))

    def send(self, text: str):
        self.id("prompt-input").fill(text)
        self.id("send-button").click()

    def answered(self, count: int = 1):
        """Waits until `count` answers are shown and none is streaming."""
        self.page.wait_for_function(
            "n => document.querySelectorAll('[data-testid=message-assistant]').length >= n"
            " && !document.querySelector('[data-streaming]')", arg=count, timeout=120_000)

    def tokens(self, message: int = -1, choice: int = 0) -> list[dict]:
        return self.page.evaluate("""([m, c]) => {
            const messages = [...document.querySelectorAll('[data-testid=message-assistant]')];
            const choice = messages.at(m).querySelectorAll('[data-testid=choice]')[c];
            return [...choice.querySelectorAll('[data-testid=token]')].map(t => ({
                prob: t.dataset.prob, token: t.dataset.token, id: Number(t.dataset.tokenId)}));
        }""", [message, choice])

    def alternatives(self, index: int) -> list[dict]:
        """Points at token `index` of the last answer; its alternatives, as shown."""
        self.id("message-assistant").last.get_by_test_id("token").nth(index).hover()
        shown = self.page.locator("[data-testid=alternatives]:not([hidden])")
        shown.wait_for()
        return shown.evaluate("""el => [...el.querySelectorAll('[data-testid=alternative]')].map(a => ({
            prob: Number(a.dataset.prob), token: a.dataset.token, id: Number(a.dataset.tokenId),
            current: a.hasAttribute('aria-current')}))""")

    def close(self):
        self.context.close()


@pytest.fixture()
def page(browser, url):
    p = Page(browser, url)
    p.connected()
    yield p
    assert p.errors == [], p.errors
    p.close()


def chat(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": [{"role": "user", "content": QUESTION}], "logprobs": True, "top_logprobs": 5, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_the_page_asks_for_the_key_keeps_it_for_the_tab_and_loads_without_console_errors(browser, url):
    p = Page(browser, url, key=None, bypass_csp=False)
    try:
        p.locator("#key-dialog[open]").wait_for()
        assert p.id("model-name").text_content() == "connecting…"
        p.id("api-key-input").fill(KEY)
        p.id("api-key-submit").click()
        p.connected()
        assert p.id("context-length").text_content() == "context 256 tokens"
        assert p.evaluate("sessionStorage.getItem('jaxserve.apiKey')") == KEY
        assert KEY not in json.dumps(p.evaluate("Object.entries(localStorage)"))
        assert p.errors == []
    finally:
        p.close()
    page = httpx.get(url + "/")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert all(m == "data:," or m.startswith("playground/") for m in re.findall(r'(?:src|href)="([^"]*)"', page.text))


def test_a_chat_answer_streams_with_each_tokens_probability_and_its_alternatives(page, url):
    page.evaluate("""() => {  // the tokens shown when the streaming answer first shows some
        window.firstShown = 0;
        new MutationObserver(() => {
            const live = document.querySelector('[data-streaming]');
            window.firstShown ||= live ? live.querySelectorAll('[data-testid=token]').length : 0;
        }).observe(document.getElementById('messages'), {childList: true, subtree: true});
    }""")
    page.settings(seed=11, max_tokens=40, temperature=0.8)
    page.send(QUESTION)
    page.answered()
    tokens = page.tokens()
    assert 0 < page.evaluate("window.firstShown") < len(tokens) / 2  # shown as they came
    # the API's answer to the same request: the same tokens, with the same probabilities
    api = chat(url, seed=11, max_tokens=40, temperature=0.8, return_tokens_as_token_ids=True)
    assert [t["id"] for t in tokens] == [int(e["token"].split(":")[1]) for e in api["logprobs"]["content"]]
    for shown, entry in zip(tokens, api["logprobs"]["content"]):
        assert 0 < float(shown["prob"]) <= 1
        assert float(shown["prob"]) == pytest.approx(math.exp(entry["logprob"]), rel=1e-5)
    assert "".join(t["token"] for t in tokens).startswith(api["message"]["content"])
    alternatives = page.alternatives(2)
    assert 5 <= len(alternatives) <= 6 and all(0 < a["prob"] <= 1 for a in alternatives)
    assert sum(a["prob"] for a in alternatives) <= 1 + 1e-6
    assert [a for a in alternatives if a["current"]] == [
        {"prob": pytest.approx(float(tokens[2]["prob"])), "token": tokens[2]["token"], "id": tokens[2]["id"],
         "current": True}]
    # by keyboard: a focused token shows its alternatives, the arrow key moves into them, Escape goes back
    page.keyboard.press("Escape")
    page.id("token").nth(4).focus()
    page.locator("[data-testid=alternatives]:not([hidden])").wait_for()
    page.keyboard.press("ArrowDown")
    assert page.evaluate("document.activeElement.dataset.testid") == "alternative"
    page.keyboard.press("Escape")
    assert page.evaluate("document.activeElement.dataset.index") == "4"
    assert page.locator("[data-testid=alternatives]").is_hidden()
    page.keyboard.press("ArrowRight")  # the arrows move along the answer; Tab leaves it
    assert page.evaluate("document.activeElement.dataset.index") == "5"
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.dataset.testid") != "token"


def test_the_end_of_turn_token_shows_no_text(page, url):
    """The chat answer's last logprob is the end-of-turn token, whose bytes name it ("<|im_end|>"): it is
    shown (its probability, its alternatives) but adds no text to the answer."""
    page.settings(max_tokens=40, temperature=0)
    page.send("hi")
    page.answered()
    api = chat(url, messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0)
    assert api["finish_reason"] == "stop" and api["logprobs"]["content"][-1]["token"] == "<|im_end|>"
    tokens = page.tokens()
    assert len(tokens) == len(api["logprobs"]["content"]) and tokens[-1]["token"] == ""
    assert "".join(t["token"] for t in tokens) == api["message"]["content"]


def test_choosing_an_alternative_branches_from_that_token_and_the_branches_are_kept(page, url):
    page.settings(seed=5, max_tokens=24, temperature=0.7)
    page.send(QUESTION)
    page.answered()
    first = page.tokens()
    at = 3
    chosen = next(a for a in page.alternatives(at) if not a["current"])
    page.locator("[data-testid=alternatives] [data-testid=alternative]:not([aria-current])").first.click()
    page.wait_for_function("document.querySelector('[data-testid=branch-label]').textContent.startsWith('branch 2 of 2')")
    page.answered()
    branch = page.tokens()
    assert branch[:at] == first[:at]
    assert (branch[at]["id"], branch[at]["token"]) == (chosen["id"], chosen["token"])
    # the rest is what the API generates after the kept tokens and the chosen one
    prompt = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": QUESTION}],
                                                 "add_generation_prompt": True}).json()["tokens"]
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json={
        "prompt": prompt + [t["id"] for t in first[:at]] + [chosen["id"]], "seed": 5, "temperature": 0.7,
        "max_tokens": 24 - at - 1, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert [t["id"] for t in branch[at + 1:]] == [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    page.id("branch-prev").click()
    assert page.tokens() == first
    page.id("branch-next").click()
    assert page.tokens() == branch


def _settled(p: Page, timeout: float = 120) -> list[str]:
    """Waits (polling from here: the page's CSP forbids Playwright's evaluated waits) until the last
    answer has tokens and none is streaming; its tokens' ids."""
    deadline = time.time() + timeout
    tokens = p.id("message-assistant").last.get_by_test_id("token")
    while p.locator("[data-streaming]").count() or not tokens.count():
        assert time.time() < deadline, "the answer did not finish"
        time.sleep(0.1)
    return [tokens.nth(i).get_attribute("data-token-id") for i in range(tokens.count())]


def test_a_whole_path_under_the_pages_own_content_security_policy(browser, url):
    """The other tests lift the page's CSP for Playwright's waits; here it holds: an answer streams,
    a token's alternatives show, choosing one branches from it, copy-as-curl gives the request, and
    nothing is refused (a CSP violation is a console error)."""
    p = Page(browser, url, bypass_csp=False)
    try:
        p.connected()
        p.settings(seed=5, max_tokens=16, temperature=0.7)
        p.send(QUESTION)
        first = _settled(p)
        assert len(first) > 3
        p.id("message-assistant").last.get_by_test_id("token").nth(2).hover()
        p.locator("[data-testid=alternatives]:not([hidden])").wait_for()
        p.locator("[data-testid=alternatives] [data-testid=alternative]:not([aria-current])").first.click()
        p.id("branch-label").filter(has_text="branch 2 of 2").wait_for()
        branch = _settled(p)
        assert branch[:2] == first[:2] and branch[2] != first[2]
        p.id("prompt-input").fill(QUESTION)
        p.id("copy-curl").click()
        command = p.id("code-output").text_content()
        assert command.startswith("curl") and QUESTION in command and re.search(r'"seed": ?5\b', command), command
        assert p.errors == [], p.errors
    finally:
        p.close()


def test_the_same_seed_twice_gives_the_same_text_and_n_choices_stand_side_by_side(page):
    page.settings(seed=3, max_tokens=12, n=2, temperature=1)
    page.send(QUESTION)
    page.answered()
    assert page.id("message-assistant").last.get_by_test_id("choice").count() == 2
    first = [page.tokens(choice=c) for c in (0, 1)]
    assert first[0] != first[1]
    page.id("regenerate-button").click()
    page.wait_for_function("document.querySelector('[data-testid=branch-label]').textContent.startsWith('branch 2')")
    page.answered()
    assert [page.tokens(choice=c) for c in (0, 1)] == first
    boxes = [page.id("choice").nth(c).bounding_box() for c in (0, 1)]
    assert boxes[0]["x"] < boxes[1]["x"] and abs(boxes[0]["y"] - boxes[1]["y"]) < 1  # side by side


def test_stop_ends_a_long_generation_and_the_server_frees_its_pages(page, url):
    page.settings(max_tokens=200, ignore_eos=True)
    page.send(QUESTION)
    page.wait_for_function("document.querySelectorAll('[data-streaming] [data-testid=token]').length >= 3",
                           timeout=120_000)
    page.id("stop-button").click()
    page.answered()
    stopped = page.tokens()
    assert len(stopped) < 200
    assert "stopped by you" in page.locator(".choice-footer").last.text_content()
    # the next turn carries the conversation, the stopped answer as far as it went
    page.id("prompt-input").fill("Thanks.")
    page.id("copy-curl").click()
    command = page.id("code-output").text_content()
    page.keyboard.press("Escape")
    messages = json.loads(command.split("-d '", 1)[1].removesuffix("'").replace("'\\''", "'"))["messages"]
    # (ignore_eos lets the model write chat markers: their tokens show, the reply's text skips them)
    text = "".join(t["token"] for t in stopped if not re.fullmatch(r"<\|[a-z_]+\|>", t["token"]))
    assert messages == [{"role": "user", "content": QUESTION},
                        {"role": "assistant", "content": text},
                        {"role": "user", "content": "Thanks."}]
    deadline = time.time() + 30
    while (used := _metric(url, "jaxserve:kv_pages_used")) != 0:
        assert time.time() < deadline, used
        time.sleep(0.2)


def _metric(url: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", httpx.get(url + "/metrics").text, re.M)[1])


def test_completion_mode_continues_a_raw_prompt(page, url):
    page.id("mode-completion").click()
    page.settings(temperature=0, max_tokens=6)
    page.send("The capital of France is")
    page.answered()
    tokens = page.tokens()
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json={
        "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6})
    assert "".join(t["token"] for t in tokens) == r.json()["choices"][0]["text"]
    assert "Paris" in r.json()["choices"][0]["text"]
    alternatives = page.alternatives(1)  # named by id in the completions form: their text comes from /detokenize
    assert all(a["token"] for a in alternatives) and sum(a["prob"] for a in alternatives) <= 1 + 1e-6
    chosen = next(a for a in alternatives if not a["current"])
    page.locator("[data-testid=alternatives] [data-testid=alternative]:not([aria-current])").first.click()
    page.wait_for_function("document.querySelector('[data-testid=branch-label]').textContent.startsWith('branch 2')")
    page.answered()
    branch = page.tokens()
    assert branch[0] == tokens[0] and (branch[1]["id"], branch[1]["token"]) == (chosen["id"], chosen["token"])
    assert len(branch) == 6  # max_tokens counts the kept and the chosen token
    page.reload()  # the mode and the settings persist
    assert page.id("mode-completion").get_attribute("aria-pressed") == "true"
    assert page.id("setting-max-tokens").input_value() == "6"


def test_copy_as_python_and_curl_reproduce_the_request(page, url):
    page.settings(seed=9, max_tokens=10, temperature=0.9, top_k=40)
    page.id("prompt-input").fill(QUESTION)
    page.id("copy-python").click()
    code = page.id("code-output").text_content()
    assert "top_k" in code and "extra_body" in code
    page.keyboard.press("Escape")
    page.id("copy-curl").click()
    command = page.id("code-output").text_content()
    page.keyboard.press("Escape")
    page.id("send-button").click()
    page.answered()
    text = "".join(t["token"] for t in page.tokens()).removesuffix("<|im_end|>")
    env = {**os.environ, "OPENAI_API_KEY": KEY}
    python = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert python.returncode == 0, python.stderr
    assert python.stdout == text
    curl = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=120)
    streamed = [json.loads(line[6:]) for line in curl.stdout.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed if c["choices"]) == text


def test_settings_are_checked_before_sending(page):
    page.settings(temperature=-1, top_p=2)
    assert page.locator("#setting-temperature-error").text_content() == "at least 0"
    assert page.locator("#setting-top-p-error").text_content() == "at most 1"
    page.id("setting-response-format").select_option("json_schema")
    page.id("setting-json-schema").fill('{"type": "thing"')
    assert page.id("schema-error").text_content().startswith("not JSON")
    page.id("setting-json-schema").fill('{"type": "thing"}')
    assert page.id("schema-error").text_content() == 'schema.type: unknown type "thing"'
    page.send(QUESTION)
    assert "not valid" in page.id("error").text_content()
    assert page.id("message-assistant").count() == 0
    # a request the server refuses leaves no answer behind, and the message back in the input
    page.id("setting-response-format").select_option("text")
    page.settings(temperature=0.5, top_p=1, max_tokens=1000)
    page.send(QUESTION)
    page.wait_for_function("document.getElementById('error').textContent.includes('256')")
    assert page.id("message-assistant").count() == 0 and page.id("message-user").count() == 0
    assert page.id("prompt-input").input_value() == QUESTION
    assert [e for e in page.errors if "status of 400" not in e] == []  # (the browser logs the refused request)
    page.errors.clear()
    page.settings(max_tokens=4)
    page.id("send-button").click()
    page.answered()
    assert len(page.tokens()) <= 4 and page.id("error").text_content() == ""


def test_accessibility_and_the_readme_screenshot(page):
    """No serious axe-core violation, with an answer and a token's alternatives shown; the README's picture."""
    from axe_playwright_python.sync_playwright import Axe

    page.settings(seed=1, max_tokens=40, temperature=0.7)
    page.id("system-prompt").fill("You are a poet.")
    page.send("Write a haiku about the sea.")
    page.answered()
    page.alternatives(3)
    results = Axe().run(page.page)
    serious = [v for v in results.response["violations"] if v["impact"] in ("serious", "critical")]
    assert serious == [], results.generate_report()
    if _taken_of(SCREENSHOT) != _page_digest():  # (not rewritten while the page is unchanged: its tokens/s vary)
        SCREENSHOT.write_bytes(_with_text(page.screenshot(), DIGEST_KEY, _page_digest()))


DIGEST_KEY = b"jaxserve-playground"  # the PNG text entry naming the page's files the picture shows


def _page_digest() -> str:
    files = sorted((ROOT / "api" / "playground").iterdir())
    return hashlib.sha256(b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)).hexdigest()


def _chunks(png: bytes):
    at = 8
    while at < len(png):
        size, kind = struct.unpack(">I4s", png[at:at + 8])
        yield kind, png[at + 8:at + 8 + size]
        at += 12 + size


def _taken_of(path: Path) -> str | None:
    if not path.exists():
        return None
    texts = dict(data.split(b"\0", 1) for kind, data in _chunks(path.read_bytes()) if kind == b"tEXt")
    return texts.get(DIGEST_KEY, b"").decode() or None


def _with_text(png: bytes, key: bytes, value: str) -> bytes:
    """`png` with a tEXt entry after its header chunk (IHDR: 8 + 25 bytes)."""
    data = key + b"\0" + value.encode()
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
    return png[:33] + chunk + png[33:]
