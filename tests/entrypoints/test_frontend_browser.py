"""The page at `/` in a real browser: headless Chromium, driven by Selenium, against real servers.

Two servers of a tiny random Llama with a tiny KV cache (a burst of requests preempts): the default
layout (an API server and an engine core) with no key, and the one-process layout with `--api-key`.
In each the page loads with no console error and a chat streamed through it shows the API's greedy
answer; the key prompt appears where a key is set; the dashboard's KV and preemption figures move
under a burst. One more server, with `--disable-frontend`, needs no browser. The browser is Debian's
`chromium` with its `chromedriver`, named by path: Selenium never downloads one. Screenshots go to a
temporary folder, or to $NANOPAGED_SCREENSHOTS (the path is printed; pytest -s shows it). docs/08_server.md, "The page".
"""
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import urllib.error
import urllib.request

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client", "zmq", "msgspec"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
KEY = "page-test-key"
MODEL_NAME = "tiny"
# 48 blocks of 4 tokens: a dozen requests of 60 tokens at once do not fit, so the burst preempts.
ENGINE_ARGS = ["--block-size", "4", "--num-kv-blocks", "48", "--max-num-seqs", "16", "--dtype", "float32"]
WAIT_S = 120                    # generous: two shared cores, and a browser beside the servers


def selenium_or_skip():
    """Selenium's webdriver, or a skip that says what is missing (.ci/run installs them where it can)."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("the browser tests need Chromium and its driver: apt-get install chromium chromium-driver")
    return pytest.importorskip("selenium.webdriver", reason="the browser tests need Selenium: pip install selenium")


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    """$NANOPAGED_SCREENSHOTS if set (a folder kept), else a pytest temporary folder."""
    chosen = os.environ.get("NANOPAGED_SCREENSHOTS")
    folder = pathlib.Path(chosen) if chosen else tmp_path_factory.mktemp("frontend_screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots of the page: {folder}")
    return folder


@pytest.fixture
def driver():
    """A fresh headless Chromium per test (its own profile folder: no key kept from another test)."""
    webdriver = selenium_or_skip()
    from selenium.webdriver.chrome.service import Service   # with webdriver, only where it is installed
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="nanopaged-chromium-")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,900",
                f"--user-data-dir={profile}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)


def serve(model: str, *flags: str):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        return start_nanopaged(model, [*ENGINE_ARGS, *flags], served_model_name=MODEL_NAME, timeout_s=WAIT_S)


@pytest.fixture(scope="module")
def processes_server(tiny_model_dirs):
    with serve(tiny_model_dirs["llama"]) as s:
        s.key = None
        yield s


@pytest.fixture(scope="module")
def in_process_server(tiny_model_dirs):
    with serve(tiny_model_dirs["llama"], "--engine-in-process", "--api-key", KEY) as s:
        s.key = KEY
        yield s


@pytest.fixture(params=["processes", "in_process_with_key"])
def server(request):
    return request.getfixturevalue({"processes": "processes_server", "in_process_with_key": "in_process_server"}
                                   [request.param])


# ---- helpers ---------------------------------------------------------------------------------------
def wait(browser, condition, timeout_s: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, timeout_s, poll_frequency=0.1).until(lambda b: condition(b))


def by_id(browser, name: str):
    return browser.find_element("id", name)


def console_errors(browser, allow_401: bool = False) -> list[str]:
    """The browser console's errors since the last call; with `allow_401`, less the 401s a keyed server
    answers before the key is given (Chromium logs each refused fetch)."""
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    return [e for e in errors if not (allow_401 and "status of 401" in e)]


def open_page(browser, server, key_to_give: str | None = None) -> None:
    """The page loaded, its key given if the server asks, its model list and dashboard in."""
    browser.get(server.base_url + "/")
    if server.key is not None:
        wait(browser, lambda b: by_id(b, "key-dialog").get_attribute("open") is not None)
        give_key(browser, key_to_give or server.key)
    wait(browser, lambda b: len(b.find_elements("css selector", "#model option")) > 0)
    wait(browser, lambda b: by_id(b, "status").text == "live")


def give_key(browser, key: str) -> None:
    by_id(browser, "key-input").send_keys(key)
    browser.find_element("css selector", "#key-form button").click()


def chat(browser, prompt: str, max_tokens: int) -> str:
    """One message through the playground at temperature 0; the answer's text once streamed."""
    for field, value in (("temperature", "0"), ("max_tokens", str(max_tokens))):
        by_id(browser, field).clear()
        by_id(browser, field).send_keys(value)
    by_id(browser, "prompt").send_keys(prompt)
    by_id(browser, "send").click()
    answer = wait(browser, lambda b: (b.find_elements("css selector", ".message.assistant") or [None])[-1])
    wait(browser, lambda b: answer.get_attribute("data-state") != "streaming")
    assert answer.get_attribute("data-state") == "done", answer.text
    return browser.execute_script("return arguments[0].textContent", answer)   # exact, unlike .text


def api_client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.key or "none", max_retries=0,
                         timeout=WAIT_S)


def figure(browser, name: str) -> str:
    return by_id(browser, name).text


# ---- the page ----------------------------------------------------------------------------------------
def test_the_page_loads_with_no_console_error(driver, server, shots):
    open_page(driver, server)
    assert [o.text for o in driver.find_elements("css selector", "#model option")] == [MODEL_NAME]
    driver.save_screenshot(str(shots / f"loaded-{'key' if server.key else 'open'}.png"))
    assert console_errors(driver, allow_401=server.key is not None) == []


def test_a_streamed_chat_shows_the_api_greedy_answer(driver, server, shots):
    prompt = "Tell me about the sea"
    expected = api_client(server).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], temperature=0, top_p=1,
        max_tokens=16).choices[0].message.content
    assert expected                      # an empty answer would prove nothing
    open_page(driver, server)
    assert chat(driver, prompt, max_tokens=16) == expected
    driver.save_screenshot(str(shots / f"chat-{'key' if server.key else 'open'}.png"))
    assert console_errors(driver, allow_401=server.key is not None) == []


def test_the_conversation_is_kept_for_the_next_message(driver, processes_server):
    """The second request carries the first exchange: its answer is the API's for the whole conversation."""
    open_page(driver, processes_server)
    first = chat(driver, "Hello", max_tokens=8)
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
                {"role": "user", "content": "And then?"}]
    expected = api_client(processes_server).chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, top_p=1, max_tokens=8).choices[0].message.content
    assert chat(driver, "And then?", max_tokens=8) == expected


def test_a_refused_request_shows_the_server_error_and_leaves_the_conversation_as_it_was(driver, processes_server):
    open_page(driver, processes_server)
    by_id(driver, "max_tokens").clear()
    by_id(driver, "max_tokens").send_keys("100000")                  # past max_model_len: a 400
    by_id(driver, "prompt").send_keys("Hello")
    by_id(driver, "send").click()
    answer = wait(driver, lambda b: (b.find_elements("css selector", ".message.assistant") or [None])[-1])
    wait(driver, lambda b: answer.get_attribute("data-state") == "error")
    assert "max_tokens" in answer.text
    expected = api_client(processes_server).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Again"}], temperature=0, top_p=1,
        max_tokens=6).choices[0].message.content
    assert chat(driver, "Again", max_tokens=6) == expected         # the refused message was not kept


def test_the_key_prompt_appears_and_a_wrong_key_is_asked_again(driver, in_process_server, shots):
    driver.get(in_process_server.base_url + "/")
    wait(driver, lambda b: by_id(b, "key-dialog").get_attribute("open") is not None)
    driver.save_screenshot(str(shots / "key-prompt.png"))
    give_key(driver, "not-the-key")
    wait(driver, lambda b: "refused" in by_id(b, "key-reason").text)
    give_key(driver, KEY)
    wait(driver, lambda b: len(b.find_elements("css selector", "#model option")) > 0)
    assert by_id(driver, "key-dialog").get_attribute("open") is None
    assert chat(driver, "Hi", max_tokens=4) is not None


def test_the_dashboard_kv_and_preemption_figures_move_under_a_burst(driver, processes_server, shots):
    open_page(driver, processes_server)
    preempted_before = count(figure(driver, "preemptions-value"))
    client = api_client(processes_server)

    def one(i: int) -> None:
        client.completions.create(model=MODEL_NAME, prompt=f"Request {i} of the burst", max_tokens=48,
                                  temperature=0, extra_body={"ignore_eos": True})
    burst = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in burst:
        t.start()
    for t in burst:
        t.join()
    # The page polls once a second; the window keeps each second's highest usage, so a short burst shows.
    wait(driver, lambda b: count(figure(b, "preemptions-value")) > preempted_before)
    wait(driver, lambda b: kv_peak(figure(b, "kv-sub")) >= 50)
    wait(driver, lambda b: figure(b, "tokens-sub") != "peak 0.0")
    driver.save_screenshot(str(shots / "dashboard-after-burst.png"))
    assert console_errors(driver) == []


def count(text: str) -> int:
    """A card's whole number; "-" (no figures from the engine yet) is 0."""
    return 0 if text == "-" else int(text)


def kv_peak(text: str) -> int:
    """The KV card's "peak 87%" as 87."""
    return int(text.removeprefix("peak ").removesuffix("%"))


def test_disable_frontend_gives_404_at_the_root(tiny_model_dirs):
    """No browser needed: the flag through the command line, in the default layout."""
    with serve(tiny_model_dirs["llama"], "--disable-frontend") as s:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(s.base_url + "/", timeout=10)
        assert refused.value.code == 404
        assert urllib.request.urlopen(s.base_url + "/v1/models", timeout=10).status == 200
