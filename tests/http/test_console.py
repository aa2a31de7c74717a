"""The web console (`GET /`) in a real headless Chromium against a real `python -m sonar serve`.

A server with `--api-key` for the module: the page loads without the key but shows no data and
asks for it; with the key it draws the supervision tree and the load charts, streams a chat answer
equal to the same greedy request over HTTP, and lists the worker's restart after its process is
killed. Against the package's `plain_server` (no key) the page asks for none. The browser is Debian's `chromium` driven through `chromedriver` by selenium (never a
browser downloaded by selenium itself); without them the browser tests fail, saying what is missing.

`SONAR_CONSOLE_SCREENSHOT=<path>` saves the page, after the chat, as a PNG
(`scripts/console_screenshot` writes `docs/console.png`).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.http.conftest import ServerProcess, serving

try:
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the browser tests fail, saying why; the HTTP one still runs
    webdriver = None

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")

KEY = "console-test-key"
SERVER_ARGS = (
    *("--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--seed", "0"),
    *("--served-model-name", "smol", "--api-key", KEY, "--disable-uvicorn-access-log"),
)
QUESTION = "Write a short poem about the sea."
MAX_TOKENS = 32
WAIT = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serving(tmp_path_factory.mktemp("console"), *SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if webdriver is None or not (CHROMIUM and CHROMEDRIVER):
        pytest.fail(
            "the console's browser tests need selenium (the test extra) and Debian's chromium and "
            "chromium-driver (scripts/_setup.sh installs them)"
        )
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    # Both paths given: selenium runs no "Selenium Manager" (which would download a driver).

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,640")
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path_factory.mktemp("chromedriver") / "log"))
    driver = webdriver.Chrome(options=options, service=service)
    yield driver
    driver.quit()


def wait_until(driver: Any, condition: Any, what: str, timeout: float = WAIT) -> Any:
    """`condition(driver)` once truthy; a failure names `what` and shows the page's state."""
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition)
    except TimeoutException:
        status = driver.find_element(By.ID, "status").text
        pytest.fail(f"{what} not within {timeout} s; status: {status!r}; page:\n{driver.page_source[-3000:]}")


def chart_values(driver: Any, chart: str) -> list[float]:
    """The first line of chart `chart` as drawn: its points' heights, 0 at the bottom."""
    points = driver.find_element(By.CSS_SELECTOR, f"#{chart} polyline").get_attribute("points") or ""
    return [100 - float(p.split(",")[1]) for p in points.split()]


def test_page_answers_without_the_key_and_data_routes_do_not(server: ServerProcess) -> None:
    page = httpx.get(f"{server.base_url}/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert 'src="console/console.js"' in page.text
    for asset in ("/console/console.js", "/console/console.css"):
        assert httpx.get(f"{server.base_url}{asset}", timeout=10).status_code == 200
    for data in ("/actors", "/metrics", "/v1/models"):
        assert httpx.get(f"{server.base_url}{data}", timeout=10).status_code == 401, data
    # Nothing else around the page opens up: a neighbouring path is refused without the key.
    assert httpx.get(f"{server.base_url}/console/other.js", timeout=10).status_code == 401


def test_page_asks_for_the_key_and_shows_no_data_until_given(server: ServerProcess, browser: Any) -> None:
    browser.get(f"{server.base_url}/")
    key_form = browser.find_element(By.ID, "key-form")
    wait_until(browser, lambda d: key_form.is_displayed(), "the API key form")
    assert browser.find_elements(By.CSS_SELECTOR, "#tree li") == []
    assert browser.find_element(By.ID, "chart-kv").get_attribute("data-points") is None
    browser.find_element(By.ID, "api-key").send_keys("wrong-key")
    browser.find_element(By.ID, "key-submit").click()
    wait_until(browser, lambda d: "invalid" in d.find_element(By.ID, "key-error").text, "the wrong key refused")
    assert browser.find_elements(By.CSS_SELECTOR, "#tree li") == []
    field = browser.find_element(By.ID, "api-key")
    field.clear()
    field.send_keys(KEY)
    browser.find_element(By.ID, "key-submit").click()
    wait_until(browser, lambda d: not key_form.is_displayed(), "the key form gone")


def test_tree_shows_the_worker_and_charts_fill(server: ServerProcess, browser: Any) -> None:
    worker = '#tree li[data-actor="worker"][data-state="running"]'
    wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, worker), "the running worker in the tree")
    for actor in ("scheduler", "detokenizer"):
        assert browser.find_elements(By.CSS_SELECTOR, f'#tree li[data-actor="{actor}"]'), actor
    assert "smol" in browser.find_element(By.ID, "model").text
    for chart in ("chart-throughput", "chart-kv", "chart-queue"):
        wait_until(browser, lambda d: int(d.find_element(By.ID, chart).get_attribute("data-points") or 0) >= 2, chart)
        assert len(chart_values(browser, chart)) >= 2


def test_chat_streams_the_greedy_answer(server: ServerProcess, browser: Any, http: httpx.Client) -> None:
    # Every change to the answer's text, as the browser renders it.
    browser.execute_script(
        """
        window.answerLengths = [];
        new MutationObserver(() => {
          const answers = document.querySelectorAll('#chat-log .message.assistant .content');
          const n = answers.length ? answers[answers.length - 1].textContent.length : 0;
          if (window.answerLengths[window.answerLengths.length - 1] !== n) window.answerLengths.push(n);
        }).observe(document.getElementById('chat-log'), {subtree: true, childList: true, characterData: true});
        """
    )
    for field, value in (("max-tokens", MAX_TOKENS), ("temperature", 0)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))
    browser.find_element(By.ID, "chat-input").send_keys(QUESTION)
    browser.find_element(By.ID, "chat-send").click()
    done = '#chat-log .message.assistant:not([data-state="streaming"])'
    wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, done), "the streamed answer")
    message = browser.find_element(By.CSS_SELECTOR, "#chat-log .message.assistant")
    answer = message.find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent")
    assert message.get_attribute("data-state") == "done", answer
    expected = http.post(
        "/v1/chat/completions",
        json={
            "model": "smol",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        },
    )
    assert expected.status_code == 200, expected.text
    assert answer == expected.json()["choices"][0]["message"]["content"]
    lengths = [n for n in browser.execute_script("return window.answerLengths;") if n > 0]
    assert len(lengths) >= 3 and lengths == sorted(lengths), lengths  # grew piece by piece
    assert lengths[-1] == len(answer)
    # The tokens just generated show in the throughput chart at its next scrapes.
    wait_until(browser, lambda d: max(chart_values(d, "chart-throughput")) > 0, "throughput above 0")
    if shot := os.environ.get("SONAR_CONSOLE_SCREENSHOT"):
        screenshot(browser, http, Path(shot))


def screenshot(browser: Any, http: httpx.Client, path: Path) -> None:
    """The page as a PNG at `path`, taken while a few requests load the server (so the charts
    show something)."""

    def generate(i: int) -> None:
        body = {"model": "smol", "prompt": f"Story {i}: once upon a time", "max_tokens": 160, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).status_code == 200

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(generate, range(4)))
        time.sleep(1.5)
        for i in range(4, 8):
            pool.submit(generate, i)
        time.sleep(2.5)
        path.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(path))


def find(node: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The node of the `/actors` tree named `name` (depth first)."""
    if node["name"] == name:
        return node
    return next((hit for child in node["children"] if (hit := find(child, name)) is not None), None)


def test_a_killed_worker_shows_in_the_restarts(server: ServerProcess, browser: Any, http: httpx.Client) -> None:
    assert browser.find_elements(By.CSS_SELECTOR, "#restarts li.muted"), "a restart before the kill"
    worker = find(http.get("/actors").json(), "worker")
    assert worker is not None and worker["placement"] == "process" and worker["pid"], worker
    os.kill(worker["pid"], signal.SIGKILL)
    restart = '#restarts li[data-actor$="worker"]'
    wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, restart), "the worker's restart listed")
    assert "restarted ×1" in browser.find_element(By.CSS_SELECTOR, restart).text
    running = '#tree li[data-actor="worker"][data-state="running"]'
    wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, running), "the worker running again")


def test_without_an_api_key_the_page_asks_for_none(plain_server: ServerProcess, browser: Any) -> None:
    browser.get(f"{plain_server.base_url}/")
    worker = '#tree li[data-actor="worker"][data-state="running"]'
    wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, worker), "the running worker in the tree")
    assert not browser.find_element(By.ID, "key-form").is_displayed()
    wait_until(browser, lambda d: int(d.find_element(By.ID, "chart-kv").get_attribute("data-points") or 0) >= 2, "KV")
