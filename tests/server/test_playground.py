"""The playground page in a real headless Chromium: type a message, watch the reply stream in."""

from __future__ import annotations

import shutil

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

MESSAGE = "how does inference work?"
MAX_TOKENS = 60
COUNT_UPDATES = """
window.__updates = 0;
new MutationObserver(() => window.__updates++).observe(
  document.getElementById("log"), {subtree: true, childList: true, characterData: true});
"""


@pytest.fixture(scope="module")
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver are missing: `make test` installs them"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    yield browser
    browser.quit()


def test_typed_message_gets_a_streamed_reply_with_timing(browser, tiny_url):
    browser.get(f"{tiny_url}/")
    WebDriverWait(browser, 120).until(lambda b: b.find_element(By.ID, "model").text == "tiny")
    for field, value in (("max-tokens", MAX_TOKENS), ("temperature", 0)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))
    browser.execute_script(COUNT_UPDATES)
    browser.find_element(By.ID, "prompt").send_keys(MESSAGE, Keys.ENTER)

    timing = WebDriverWait(browser, 120).until(lambda b: b.find_element(By.CSS_SELECTOR, ".timing").text or None)
    reply = browser.find_element(By.CSS_SELECTOR, ".msg.assistant").text
    expected = httpx.post(
        f"{tiny_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": MAX_TOKENS, "temperature": 0},
    ).json()
    # The browser renders whitespace as the page's CSS says; compare the words.
    assert reply.split() == expected["choices"][0]["message"]["content"].split()
    assert reply.strip()
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == MESSAGE
    assert browser.execute_script("return window.__updates") > 3, "the reply arrived in one piece, not streamed"
    for word in ("TTFT", "tokens/s", "ITL", "prefill", "decode"):
        assert word in timing
