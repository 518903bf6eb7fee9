"""The browser page (serve/static/index.html, GET /) in headless Chromium through Selenium,
against `trt-spec serve` on the int4 SmolLM2 engine (exported once per session, with its drafters):
a streamed answer marks its accepted draft tokens under ngram and none under none; side by
side with plain decoding the greedy texts are identical; a JSON-schema answer reads back as
JSON; model text (and a crafted token list) never becomes markup; a refused request shows the
server's message in place; the API key is asked for, and the page waits out a server
restart without losing the conversation. Skipped without Chromium, chromedriver or selenium
(`apt-get install chromium chromium-driver`; selenium is in the dev extra)."""

import json
import shutil

import pytest

from tests.server_util import free_port, start_server

pytestmark = pytest.mark.slow

KEY = "page-test-key"
REPEAT = "Repeat the sentence 'The quick brown fox jumps over the lazy dog.' five times."
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer"}}}
WAIT_S = 90  # an answer on two CPU threads; the checks wait on the page's hooks, never time


def chromium() -> tuple[str, str]:
    """Chromium and its chromedriver, or a skip naming what is missing."""
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                  "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no Chromium or chromedriver on PATH (apt-get install chromium "
                    "chromium-driver)")
    return binary, driver


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    binary, driver = chromium()
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.binary_location = binary
    d = webdriver.Chrome(service=Service(driver), options=options)  # no Selenium Manager
    yield d
    d.quit()


@pytest.fixture(scope="module")
def engine(smollm2_int4_spec_engine):
    """The int4 SmolLM2 engine with its shipped drafters, exported once per session."""
    return smollm2_int4_spec_engine


@pytest.fixture(scope="module")
def server(engine):
    s = start_server(engine, "--max-num-seqs", "2", model="smollm2", timeout=180)
    yield s
    assert s.stop() == 0


def wait(d, condition, timeout: float = WAIT_S):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(d, timeout, ignored_exceptions=(StaleElementReferenceException,)
                         ).until(condition)


def open_page(d, url: str) -> None:
    """The page with nothing kept from a test before (conversation, controls, key), once it
    has read the served model's methods."""
    from selenium.webdriver.common.by import By

    d.get(f"{url}/")
    d.execute_script("sessionStorage.clear()")
    d.get(f"{url}/")
    wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#method option")) > 1)


@pytest.fixture
def page(browser, server):
    open_page(browser, server.url)
    return browser


def fill(d, field: str, value) -> None:
    """Sets a control by its id as a user would: picks, ticks or types."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    e = d.find_element(By.ID, field)
    if e.tag_name == "select":
        Select(e).select_by_value(value)
    elif e.get_attribute("type") == "checkbox":
        if e.is_selected() != value:
            e.click()
    else:
        e.clear()
        e.send_keys(value)


def ask(d, prompt: str, **controls):
    """Sets the controls (top_p -> #top-p), sends `prompt` and returns its .msg.assistant once
    its request ended (data-done)."""
    from selenium.webdriver.common.by import By

    for name, value in controls.items():
        fill(d, name.replace("_", "-"), value)
    before = len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    fill(d, "prompt", prompt)
    d.find_element(By.ID, "send").click()

    def ended(d):
        msgs = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        return len(msgs) > before and msgs[-1].get_attribute("data-done") == "true" and msgs[-1]
    return wait(d, ended)


def tokens(d, msg) -> list[dict]:
    """The message's answer tokens as shown: source, text and hover text of each span."""
    return d.execute_script(
        "return [...arguments[0].querySelectorAll(':scope > .body span.tok')].map(s => ("
        "{source: s.dataset.source, text: s.textContent, title: s.title}))", msg)


def test_draft_tokens_are_marked_under_ngram_and_none_under_none(page):
    from selenium.webdriver.common.by import By

    msg = ask(page, REPEAT, method="ngram", k="4", temperature="0", max_tokens="64")
    assert msg.get_attribute("data-error") is None
    shown = tokens(page, msg)
    sources = {t["source"] for t in shown}
    assert "lookup" in sources and "target" in sources, shown  # the prompt's own n-grams
    drafted = next(t for t in shown if t["source"] == "lookup")
    assert "step" in drafted["title"] and "ngram drafted" in drafted["title"], drafted
    stats = msg.find_element(By.CSS_SELECTOR, ".stats").text
    assert "τ" in stats and "tokens/s" in stats and "first token" in stats, stats

    msg = ask(page, REPEAT, method="none", max_tokens="64")
    shown = tokens(page, msg)
    assert shown and {t["source"] for t in shown} == {"target"}


def test_side_by_side_with_plain_decoding_is_identical_when_greedy(page):
    from selenium.webdriver.common.by import By

    ask(page, REPEAT, method="ngram", k="4", temperature="0", max_tokens="64",
        side_by_side=True)
    compare = wait(page, lambda d: d.find_elements(By.ID, "compare") or False)[0]
    assert compare.get_attribute("data-identical") == "true", compare.text
    assert "speculative" in compare.text and "plain" in compare.text
    spec = page.find_element(By.CSS_SELECTOR, ".msg.assistant")
    plain = page.find_element(By.CSS_SELECTOR, ".msg.plain")
    assert plain.get_attribute("data-done") == "true" and plain.get_attribute("data-error") is None
    plain_tokens = tokens(page, plain)
    assert {t["source"] for t in plain_tokens} == {"target"}
    assert [t["text"] for t in tokens(page, spec)] != []
    # only the speculative answer joins the conversation sent next
    history = page.execute_script("return JSON.parse(sessionStorage.getItem("
                                  "'trt-spec.page.conversation'))")
    assert len(history) == 1 and history[0]["plain"]["kind"] == "plain"


def test_a_json_schema_answer_reads_back_as_json(page):
    msg = ask(page, "Give a person's name and age as JSON.", method="ngram", k="4",
              temperature="0", max_tokens="96", schema=json.dumps(PERSON))
    assert msg.get_attribute("data-error") is None
    shown = tokens(page, msg)
    answer = json.loads("".join(t["text"] for t in shown))
    assert set(answer) == {"name", "age"} and isinstance(answer["age"], int)
    assert "grammar" in {t["source"] for t in shown}  # the structure's forced tokens


def test_model_text_never_becomes_markup(page):
    from selenium.webdriver.common.by import By

    msg = ask(page, "Repeat exactly: <script>window.pwned=1</script><b>bold</b>",
              method="ngram", temperature="0", max_tokens="48")
    assert msg.get_attribute("data-error") is None
    body = msg.find_element(By.CSS_SELECTOR, ".body")
    assert not body.find_elements(By.CSS_SELECTOR, "script, b, img, iframe")
    if "<" in "".join(t["text"] for t in tokens(page, msg)):
        assert "<" in body.text  # shown as the characters it is
    assert page.execute_script("return typeof window.pwned") == "undefined"

    # the renderer itself, on a crafted answer: markdown becomes structure, markup stays text
    crafted = [("# Title\n", "target"), ("Some ", "lookup"), ("**bold**", "head"),
               (" and *it*", "target"), (" <script>window.pwned=2</script>", "draft"),
               ('<img src=x onerror="window.pwned=3">', "corpus"),
               ("\n\n- one\n- `two`", "grammar"), ("\n\n```\n<b>code</b>\n```", "target")]
    toks = [{"id": i, "text": t, "source": s, "drafter": None if s == "target" else "suffix",
             "step": i, "position": 1, "drafted": 0 if s == "target" else 2}
            for i, (t, s) in enumerate(crafted)]
    got = page.execute_script(
        "const box = document.createElement('div'); document.body.append(box);"
        "window.trtRender(arguments[0], box);"
        "const out = {tags: [...box.querySelectorAll('*')].map(e => e.tagName.toLowerCase()),"
        " strong: box.querySelector('strong span.tok').dataset.source,"
        " spans: [...box.querySelectorAll('span.tok')].map(s => s.dataset.source),"
        " items: [...box.querySelectorAll('li')].map(e => e.textContent),"
        " code: box.querySelector('pre code').textContent, text: box.textContent};"
        "box.remove(); return out;", toks)
    assert set(got["tags"]) == {"h1", "p", "span", "strong", "em", "ul", "li", "code", "pre"}
    assert got["strong"] == "head" and got["items"] == ["one", "two"]
    assert got["code"] == "<b>code</b>"
    assert "<script>window.pwned=2</script>" in got["text"] and "<img src=x" in got["text"]
    assert set(got["spans"]) == {"target", "lookup", "head", "draft", "corpus", "grammar"}
    assert page.execute_script("return typeof window.pwned") == "undefined"


def test_a_refused_request_shows_the_servers_message_in_place(page):
    from selenium.webdriver.common.by import By

    msg = ask(page, "Say hi.", max_tokens="-5")
    assert "max_tokens=-5" in msg.get_attribute("data-error")
    shown = msg.find_element(By.CSS_SELECTOR, ".error")
    assert "max_tokens=-5" in shown.text and page.find_element(By.ID, "error").text == shown.text
    # a schema the page parses and the server refuses
    msg = ask(page, "Say hi.", max_tokens="16", schema='{"type": "bogus"}')
    assert "json_schema" in msg.get_attribute("data-error")
    # one that does not parse: nothing is sent, the error shows beside the schema
    fill(page, "schema", "{not json")
    fill(page, "prompt", "Say hi.")
    page.find_element(By.ID, "send").click()
    error = wait(page, lambda d: d.find_element(By.ID, "error").is_displayed()
                 and d.find_element(By.ID, "error"))
    assert "does not parse" in error.text
    assert len(page.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2
    assert page.find_element(By.ID, "prompt").get_attribute("value") == "Say hi."


def test_the_key_is_asked_for_and_a_restart_loses_nothing(browser, engine):
    from selenium.webdriver.common.by import By

    d, port = browser, free_port()
    args = (engine, "--api-key", KEY, "--protect-metrics")
    s = start_server(*args, model="smollm2", timeout=180, port=port)
    try:
        d.get(f"{s.url}/")  # the page itself needs no key
        d.execute_script("sessionStorage.clear()")
        d.get(f"{s.url}/")
        key = wait(d, lambda d: d.find_element(By.ID, "api-key").is_displayed()
                   and d.find_element(By.ID, "api-key"))
        key.send_keys(KEY)
        d.find_element(By.ID, "key-save").click()
        wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#method option")) > 1)
        assert ask(d, "Say hi.", max_tokens="8").get_attribute("data-error") is None
        assert d.execute_script("return sessionStorage.getItem('trt-spec.page.api-key')") == KEY

        assert s.stop() == 0
        state = lambda want: lambda d: (  # noqa: E731
            d.find_element(By.ID, "connection").get_attribute("data-state") == want)
        wait(d, state("gone"), 30)  # the /metrics poll found no server
        assert "went away" in d.find_element(By.ID, "connection").text
        assert not d.find_element(By.ID, "send").is_enabled()
        s = start_server(*args, model="smollm2", timeout=180, port=port)
        wait(d, state("ok"), 30)
        assert ask(d, "Say hi again.", max_tokens="8").get_attribute("data-error") is None
        d.refresh()  # the conversation is the tab's: both turns are still there
        wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.user")) == 2)
    finally:
        s.stop()
