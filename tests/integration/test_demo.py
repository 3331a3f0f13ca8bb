"""The README's demo command end to end, as a newcomer runs it: `iotmon demo --fresh`, the dashboard open in a
real (headless) Chromium until the first anomaly shows, then Ctrl-C. The loop must close by itself: the fleet
feeds the stream, the periodic trainer learns from the archive and promotes a champion, the scorer picks it
up without a restart, and the page shows what the model flagged. Afterwards the lake reconciles exactly and
nothing the demo started is left running."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from iotmon import broker
from iotmon.config import Settings
from iotmon.schema import ANOMALIES
from tests.browser import ARTIFACTS, errors, screenshot, text, until
from tests.support import free_port, wait_for, with_own_broker

pytestmark = pytest.mark.integration

DEVICES = 20
RATE = 40
"""Events/s: a small fleet. The two cores also run the trainer, the dashboard, the MLflow UI and the browser,
and the stream's seven queries cost most of a core whatever the rate; every event more is backlog the scorer
catches up on after the first promotion and the stop drains and reconciles (2026-11-25, 50 devices at 100/s:
first anomaly after 1,064 s, and the stop took over 600 s). What the pipeline sustains is `iotmon bench`'s."""
CONSOLE_NOISE = re.compile(r"\b(WARN|WARNING|Traceback|Exception)\b|^\s+at |^\d{2}/\d{2}/\d{2} ")
"""What a clean run must not print: log lines of Spark or a library, stack traces (see ``iotmon.logs``)."""
FIRST_ANOMALY_TIMEOUT = 1200.0
"""Seconds from the demo's start: the stream starts, silver spans four feature histories, a model is trained
and promoted, and the scorer catches up. That took 690-1,064 s on 2026-11-25 (eight cold queries and a trainer's
cold JVM sharing 2 cores), 357 s on 2026-11-26, and 173-216 s once the trainer ran in the stream's warm JVM
(issue 17's target is 120 s, see docs/cost-model.md). The timeout leaves room for a loaded CI machine."""


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _flagged(settings: Settings) -> bool:
    """Whether the anomalies table holds a flagged reading (delta-rs: no Spark, no competing JVM)."""
    from deltalake import DeltaTable

    path = settings.table_path(ANOMALIES)
    if not DeltaTable.is_deltatable(path):
        return False
    dataset = DeltaTable(path).to_pyarrow_dataset()
    return dataset.count_rows(filter=ds.field("is_anomaly")) > 0


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(FIRST_ANOMALY_TIMEOUT + 900)  # then Ctrl-C: drain, reconcile, stop
def test_demo_closes_the_loop_on_the_dashboard_then_stops_cleanly_on_ctrl_c(
    base_settings: Settings, tmp_path: Path, browser: Any
) -> None:
    # The demo's own settings, except a short feature history: the first model needs 20 s of silver instead of
    # 4 minutes, so the demo publishes a past of 20 s. The first model is trained as soon as there is enough
    # data; retraining follows every 5 minutes, as in the real demo, so a trainer busy back to back does not
    # starve the stream of one of the machine's two cores.
    settings = dataclasses.replace(
        with_own_broker(base_settings, tmp_path),
        feature_history="5 seconds",
        trigger_interval=Settings.trigger_interval,
        dashboard_port=free_port(),
        mlflow_ui_port=free_port(),
    )
    log = tmp_path / "demo.log"
    command = [
        *(sys.executable, "-m", "iotmon.cli", "demo", "--fresh"),
        *("--devices", str(DEVICES), "--rate", str(RATE)),
    ]
    started = time.monotonic()
    with log.open("w") as out:  # a session of its own: a failed test can stop the demo and all it started
        demo = subprocess.Popen(
            command, env=settings.child_env(), stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

    def output() -> str:
        return log.read_text()[-6000:]

    def up(url: str) -> bool:
        assert demo.poll() is None, f"the demo exited early:\n{output()}"
        return _answers(url)

    try:
        wait_for(lambda: "simulator: " in log.read_text(), 180, "the simulator to start", poll=0.2)
        simulator_started_at = time.time()
        dashboard = f"http://127.0.0.1:{settings.dashboard_port}/"
        wait_for(lambda: up(dashboard), 180, "the dashboard to answer", poll=0.5)
        browser.get(dashboard)
        until(browser, lambda d: text(d, "fleet-total") is not None, "the fleet section")
        assert errors(browser) == []

        # A page left open refreshes itself every IOTMON_DASHBOARD_REFRESH: with the browser that costs about half
        # a core, which on 2 cores the first training needs. So, as someone who comes back later, leave the page
        # while the loop closes, and open it again once the lake holds a flagged reading.
        browser.get("about:blank")
        wait_for(lambda: up(dashboard) and _flagged(settings), FIRST_ANOMALY_TIMEOUT, "the first anomaly", poll=5)
        first_anomaly_s = time.monotonic() - started
        browser.get(dashboard)
        rows = until(
            browser,
            lambda d: d.find_elements("css selector", "#anomalies-table tbody tr"),
            "the first anomaly on the dashboard",
        )
        cells = rows[0].find_elements("tag name", "td")
        assert cells[1].text.startswith("dev-"), "the device that raised it"
        assert int(cells[-1].text) >= 1, "the model version that flagged it"
        until(browser, lambda d: text(d, "fleet-total") == str(DEVICES), f"a fleet of {DEVICES} devices")
        until(browser, lambda d: "champion: iotmon-anomaly v" in (text(d, "champion") or ""), "the champion")
        assert errors(browser) == []
        shot = screenshot(browser, "demo-dashboard.png")
        timings = {"first_anomaly_in_lake_s": round(first_anomaly_s, 1), "screenshot": str(shot)}
        (ARTIFACTS / "demo-timings.json").write_text(json.dumps(timings, indent=2))
        browser.get("about:blank")

        mlflow_ui = f"http://127.0.0.1:{settings.mlflow_ui_port}/"
        wait_for(lambda: up(mlflow_ui), 120, "the MLflow UI to answer", poll=0.5)

        demo.send_signal(signal.SIGINT)  # Ctrl-C: drain, reconcile, stop everything
        demo.wait(600)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
            broker.stop(settings)  # the broker runs detached from the demo's session

    assert demo.returncode == 0, output()
    text_out = log.read_text()
    noise = [line for line in text_out.splitlines() if CONSOLE_NOISE.search(line)]
    assert noise == [], f"{len(noise)} lines of library output on the console, e.g. {noise[:5]}"
    assert (settings.home / "logs" / "demo.log").stat().st_size > 0, "where the stream's Spark logged"
    assert "RESULT: exact" in text_out, output()
    assert "delivered  " in text_out  # the simulator's summary reached the user
    assert "  PROMOTED: " in text_out, "the periodic trainer's report of the champion it promoted"
    assert not broker.status(settings).running
    # A fresh demo first publishes the past its first model needs (4 feature histories), then goes live.
    assert "after their last 20s of readings at once" in text_out, output()
    (truth,) = (tmp_path / "truth").glob("demo-*.parquet")
    first_event = pc.min(pq.read_table(truth, columns=["event_time"]).column("event_time")).as_py()
    # The simulator reads its clock once started (its imports, a busy machine: seconds after the demo launched
    # it), and its past reaches 20 s before that; without a past, the first reading would follow the launch.
    assert first_event.timestamp() <= simulator_started_at - 10, "the past precedes the simulator's start"
    assert not list((tmp_path / "truth").glob("*.live"))  # the simulator's live truth is cleaned up
    # The trainer runs in the stream's Spark session: it trained there, and its thread ended with the demo.
    assert "trainer: retrains every 300 s in the stream's Spark session" in text_out, output()
    assert "trained iotmon-anomaly run " in text_out, output()
    assert not _listening(settings.dashboard_port) and not _listening(settings.mlflow_ui_port)
