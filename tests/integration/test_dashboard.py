"""`iotmon dashboard` in a real headless Chromium, over a lake made by a real (short) pipeline run.

The dashboard starts first, on the empty lake, as an operator would at the start of a demo: it must say it is
waiting, without errors. Then a small fleet goes through the real broker, the streaming queries, a training
run and the scorer, and the same page, refreshing by itself, must show the fleet counts the lake holds and
the anomalies the model flagged. A screenshot is kept in ``var/test-artifacts/``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from dashboard.shaping import NOT_REPORTED, TOTAL
from ingest.archive import ARCHIVE_QUERIES, ensure_archive_tables
from iotmon.config import Settings
from iotmon.ops import install_progress_recorder
from iotmon.queries import run_until_idle
from iotmon.schema import ALERTS, ANOMALIES, DEGRADED, DEVICE_STATUS, DEVICE_WINDOWS, DEVICES, OFFLINE, ONLINE
from ml.train import TrainOptions, train
from simulators.options import SimulationOptions
from simulators.publish import run_simulation
from streaming.alerts import ALERTS_QUERY
from streaming.jobs import ANALYTICS_QUERIES, ensure_analytics_tables
from streaming.scoring import SCORING_QUERY
from tests.support import PROJECT_ROOT, cli_env, free_port, wait_for

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = PROJECT_ROOT / "var" / "test-artifacts"
START = dt.datetime(2026, 11, 21, 6, 0, 0, tzinfo=dt.UTC)
PAGE_TIMEOUT = 120.0
"""Seconds for the page to show what is asked: a loaded 2-core machine renders plotly slowly."""


@pytest.fixture
def browser() -> Iterator[Any]:
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


def _start_dashboard(settings: Settings) -> tuple[subprocess.Popen, str]:
    """`iotmon dashboard` as a child process; returns it and its URL once the page answers."""
    process = subprocess.Popen(
        [sys.executable, "-m", "iotmon.cli", "dashboard", "--port", str(settings.dashboard_port)],
        env=cli_env(settings),
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first_line = process.stdout.readline()
    url = f"http://127.0.0.1:{settings.dashboard_port}/"
    assert first_line.startswith(f"dashboard: {url} "), first_line + (process.stdout.read() if process.poll() else "")

    def answers() -> bool:
        assert process.poll() is None, f"dashboard exited: {process.stdout.read()}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    wait_for(answers, 60, "the dashboard to answer", poll=0.2)
    return process, url


def _run_pipeline(spark, settings: Settings) -> None:
    """Simulate a small fleet, stream it into the lake, train a champion, then score and alert. The final
    windows query is left out (the page only draws its sliding averages, and it is the slowest query)."""
    truth = settings.home / "truth.parquet"
    options = SimulationOptions(
        devices=20, seed=5, duration=90, interval=1.0, start=START, truth_path=truth, progress=False
    )
    assert run_simulation(settings, options).failed == 0
    ensure_archive_tables(spark, settings)
    ensure_analytics_tables(spark, settings)
    with install_progress_recorder(spark, settings):
        before_model = [spec for spec in ANALYTICS_QUERIES if spec.name not in (DEVICE_WINDOWS, ANOMALIES, ALERTS)]
        run_until_idle(spark, settings, (*ARCHIVE_QUERIES, *before_model))
        assert train(spark, settings, TrainOptions(truth=(truth,))).promoted
        run_until_idle(spark, settings, (SCORING_QUERY, ALERTS_QUERY))


def _expected_fleet(settings: Settings) -> dict[str, int]:
    """Device counts straight from the lake (delta-rs), computed independently of the dashboard's code."""
    registry = set(DeltaTable(settings.table_path(DEVICES)).to_pandas(columns=["device_id"])["device_id"])
    status = DeltaTable(settings.table_path(DEVICE_STATUS)).to_pandas(columns=["device_id", "status"])
    counts = {state: int((status["status"] == state).sum()) for state in (ONLINE, DEGRADED, OFFLINE)}
    counts[NOT_REPORTED] = len(registry - set(status["device_id"]))
    counts[TOTAL] = len(registry | set(status["device_id"]))
    return counts


def _until(driver: Any, condition: Callable[[Any], Any], what: str) -> Any:
    """Wait for a DOM condition; the page re-renders every refresh, so stale elements just mean "look again"."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(
        driver, PAGE_TIMEOUT, poll_frequency=0.25, ignored_exceptions=(StaleElementReferenceException,)
    )
    try:
        return wait.until(condition)
    except TimeoutException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "dashboard-timeout.png"))
        try:
            page = driver.find_element("tag name", "body").text
        except NoSuchElementException:
            page = "(no page)"
        raise AssertionError(f"timed out waiting for {what}; the page shows:\n{page[:3000]}") from None


def _text(driver: Any, element_id: str) -> str | None:
    found = driver.find_elements("id", element_id)
    return found[0].text if found else None


def _errors(driver: Any) -> list[str]:
    return [element.text for element in driver.find_elements("css selector", ".error")]


def test_dashboard_waits_on_an_empty_lake_then_shows_the_pipelines_fleet_and_anomalies(
    isolated: Settings, spark, browser
) -> None:
    settings = dataclasses.replace(
        isolated, feature_history="5 seconds", dashboard_port=free_port(), dashboard_refresh="2 seconds"
    )
    process, url = _start_dashboard(settings)
    try:
        browser.get(url)
        # Nothing exists yet: every section says what it waits for, none fails.
        _until(browser, lambda d: _text(d, "fleet-total") == "0", "the empty fleet")
        _until(browser, lambda d: len(d.find_elements("css selector", ".waiting")) >= 4, "waiting messages")
        assert _errors(browser) == []
        assert "no registered versions" in _until(browser, lambda d: _text(d, "models"), "the models section")

        _run_pipeline(spark, settings)
        expected = _expected_fleet(settings)
        assert expected[TOTAL] == 20, expected
        anomalies = DeltaTable(settings.table_path(ANOMALIES)).to_pandas(columns=["is_anomaly", "model_version"])
        flagged = anomalies[anomalies["is_anomaly"]]
        assert len(flagged) > 0, "the model flagged nothing: the test's fleet needs anomalies"

        # The open page refreshes by itself (no reload) and shows what the lake holds.
        def fleet_matches(driver: Any) -> bool:
            return all(_text(driver, f"fleet-{state.replace(' ', '-')}") == str(n) for state, n in expected.items())

        _until(browser, fleet_matches, f"fleet counts {expected}")
        rows = _until(browser, lambda d: d.find_elements("css selector", "#anomalies-table tbody tr"), "an anomaly row")
        cells = rows[0].find_elements("tag name", "td")
        assert cells[-1].text == "1", "the model version that flagged the anomaly"
        assert cells[1].text.startswith("dev-")
        # The recorder flushed every query's batches and marked the run file stopped when the pipeline ended.
        _until(browser, lambda d: _text(d, "stream-state") == "stream not running", "the stream's end")
        recorded = {spec.name for spec in (*ARCHIVE_QUERIES, *ANALYTICS_QUERIES)} - {DEVICE_WINDOWS}
        _until(
            browser,
            lambda d: (
                {row.text.split()[0] for row in d.find_elements("css selector", "#queries-table tbody tr")} == recorded
            ),
            f"pipeline health rows of {sorted(recorded)}",
        )
        _until(
            browser,
            lambda d: "champion: iotmon-anomaly v1 since" in (_text(d, "champion") or ""),
            "the champion model",
        )
        _until(
            browser,
            lambda d: d.find_elements("css selector", "#device-graph .scatterlayer .trace"),
            "the device's chart",
        )
        assert _errors(browser) == []

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    assert "Traceback" not in output, output
