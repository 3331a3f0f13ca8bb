"""Driving the dashboard in Debian's headless Chromium (selenium): explicit waits on the page, never sleeps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import PROJECT_ROOT

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = PROJECT_ROOT / "var" / "test-artifacts"
PAGE_TIMEOUT = 120.0
"""Seconds for the page to show what is asked: a loaded 2-core machine renders plotly slowly."""


def chromium() -> Iterator[Any]:
    """Headless Chromium from the distribution (`make browser` installs it); missing is a failure, not a skip."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found: the dashboard test needs Debian's chromium and chromium-driver "
            "(`make browser`, or `apt-get install chromium chromium-driver` as root)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,2400"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path


def until(driver: Any, condition: Callable[[Any], Any], what: str, timeout: float = PAGE_TIMEOUT) -> Any:
    """Wait for a DOM condition; the page re-renders every refresh, so stale elements just mean "look again".
    On timeout, a screenshot and the page's text say what it showed instead."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, timeout, poll_frequency=0.25, ignored_exceptions=(StaleElementReferenceException,))
    try:
        return wait.until(condition)
    except TimeoutException:
        screenshot(driver, "dashboard-timeout.png")
        try:
            page = driver.find_element("tag name", "body").text
        except NoSuchElementException:
            page = "(no page)"
        raise AssertionError(f"timed out waiting for {what}; the page shows:\n{page[:3000]}") from None


def text(driver: Any, element_id: str) -> str | None:
    found = driver.find_elements("id", element_id)
    return found[0].text if found else None


def errors(driver: Any) -> list[str]:
    return [element.text for element in driver.find_elements("css selector", ".error")]
