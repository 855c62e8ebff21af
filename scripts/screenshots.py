"""Screenshots of the Prefect UI (and MLflow) for the README, taken with headless Chromium.

Run against a running stack (`sluicegate demo` or `sluicegate up` plus a pushed dataset)::

    .venv/bin/python scripts/screenshots.py [--out docs/images] [--api-url URL] [--flow-run ID]

It finds the newest pipeline flow run through Prefect's REST API (tag ``pipeline``; a COMPLETED one
named ``pipeline/...`` first), drives Chromium over the DevTools protocol (``websockets``, already a
Prefect dependency), waits on each page until the text it should show is there (the run's name, its
task runs, its artifacts), lets it settle and captures it:

    prefect-flow-runs.png      /runs                               the flow runs list
    prefect-pipeline-run.png   /runs/flow-run/<id>                 the run's graph of task runs and its logs
    prefect-artifacts.png      /runs/flow-run/<id>, tab Artifacts  the run's artifacts (gate reports, summary)
    prefect-summary.png        /artifacts/artifact/<id>            the pipeline summary artifact
    mlflow-run.png             MLflow's page of the run's MLflow run (skipped with --no-mlflow)

Each PNG is checked not to be blank (distinct colours, share of the dominant colour); the script
exits non-zero with the reason when a page did not render. Chromium: Debian's `apt-get install chromium`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from PIL import Image
from websockets.sync.client import ClientConnection, connect

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Below these a capture is taken for a page that did not render (an empty dark or white page).
MIN_COLOURS = 64
MAX_DOMINANT_SHARE = 0.96


class ShotError(Exception):
    """A step failed; the message says what to do."""


@dataclass(frozen=True)
class Shot:
    file: str
    url: str
    expect: tuple[str, ...]  # texts the page shows once rendered
    tab: str | None = None  # a tab to click then (the UI ignores ?tab= on a fresh load)
    expect_tab: tuple[str, ...] = ()  # texts the tab shows once rendered
    settle: float = 3.0  # seconds after the texts appear (canvas graphs, images, fonts)


def default_urls() -> tuple[str, str, str]:
    """The Prefect API URL, MLflow URL and experiment name from sluicegate's settings."""
    sys.path.insert(0, str(ROOT))
    from sluicegate.settings import Settings

    settings = Settings()
    return settings.prefect.url, settings.mlflow.url, settings.mlflow.experiment


# --- Prefect / MLflow REST -------------------------------------------------------------------------


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> Any:
    response = client.post(url, json=body)
    response.raise_for_status()
    return response.json()


def pipeline_run(client: httpx.Client, api: str, flow_run_id: str | None) -> dict[str, Any]:
    """The flow run to show: the given one, else the newest COMPLETED ``pipeline/...`` run tagged
    ``pipeline``, else the newest finished one, else the newest."""
    if flow_run_id:
        response = client.get(f"{api}/flow_runs/{flow_run_id}")
        if response.status_code == 404:
            raise ShotError(f"no flow run {flow_run_id} on {api}")
        response.raise_for_status()
        run: dict[str, Any] = response.json()
        return run
    body = {"flow_runs": {"tags": {"all_": ["pipeline"]}}, "sort": "START_TIME_DESC", "limit": 50}
    runs: list[dict[str, Any]] = post(client, f"{api}/flow_runs/filter", body)
    named = [r for r in runs if r["name"].startswith("pipeline/")] or runs
    for wanted in ({"COMPLETED"}, {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}):
        for run in named:
            if run.get("state_type") in wanted:
                return run
    if named:
        return named[0]
    raise ShotError(
        f"no pipeline flow run on {api}: run `sluicegate demo`, or `sluicegate up` and push a dataset "
        "(`sluicegate dataset make-sample DIR --count 600` then `sluicegate dataset push DIR --name pcb`)"
    )


def run_artifacts(client: httpx.Client, api: str, flow_run_id: str) -> list[dict[str, Any]]:
    body = {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "CREATED_DESC", "limit": 50}
    artifacts: list[dict[str, Any]] = post(client, f"{api}/artifacts/filter", body)
    return artifacts


def summary_artifact(artifacts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The pipeline summary (key ``pipeline-<dataset>``), else a markdown gate report, else any."""
    for artifact in artifacts:
        if str(artifact.get("key") or "").startswith("pipeline-"):
            return artifact
    markdown = [a for a in artifacts if a.get("type") == "markdown"]
    candidates = markdown or artifacts
    return candidates[0] if candidates else None


def mlflow_run_url(client: httpx.Client, mlflow: str, experiment: str, flow_run_id: str) -> tuple[str, str] | None:
    """The MLflow UI URL and name of the run tagged with the flow run's id, if MLflow answers."""
    try:
        response = client.get(
            f"{mlflow}/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": experiment}
        )
        response.raise_for_status()
        experiment_id = response.json()["experiment"]["experiment_id"]
        body = {
            "experiment_ids": [experiment_id],
            "filter": f"tags.`sluicegate.prefect_flow_run_id` = '{flow_run_id}'",
            "max_results": 1,
        }
        runs = post(client, f"{mlflow}/api/2.0/mlflow/runs/search", body).get("runs", [])
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        print(f"MLflow run not found ({exc}); skipping its screenshot", file=sys.stderr)
        return None
    if not runs:
        print(f"no MLflow run tagged with flow run {flow_run_id}; skipping its screenshot", file=sys.stderr)
        return None
    info = runs[0]["info"]
    return f"{mlflow}/#/experiments/{experiment_id}/runs/{info['run_id']}", info.get("run_name") or info["run_id"]


# --- Chromium over the DevTools protocol -----------------------------------------------------------


def find_browser(explicit: str | None) -> str:
    for name in (explicit,) if explicit else BROWSERS:
        path = shutil.which(name) if name else None
        if path:
            return path
    raise ShotError(
        "no Chromium found (tried " + ", ".join((explicit,) if explicit else BROWSERS) + "): "
        "install it (Debian: apt-get install chromium)"
    )


@contextlib.contextmanager
def browser(binary: str, width: int, height: int) -> Iterator[ClientConnection]:
    """A headless Chromium on a throwaway profile; yields the DevTools connection of its page."""
    with tempfile.TemporaryDirectory(prefix="sluicegate-chromium-", ignore_cleanup_errors=True) as profile:
        argv = [
            binary,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--mute-audio",
            # No network here but loopback: without these Chromium keeps dialling Google's hosts.
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-quic",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            port = _devtools_port(Path(profile), proc)
            page = _page_target(port)
            ws = connect(page, max_size=None, open_timeout=30)
            try:
                yield ws
            finally:
                ws.close()
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop Chromium and its helper processes (its own session: the process group it leads)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return  # the whole group is gone
            time.sleep(0.1)


def _devtools_port(profile: Path, proc: subprocess.Popen[bytes]) -> int:
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ShotError(f"Chromium exited with code {proc.returncode} while starting")
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(marker.read_text().splitlines()[0])
        time.sleep(0.2)
    raise ShotError("Chromium did not open its DevTools port within 60 s")


def _page_target(port: int) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            for target in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json():
                if target.get("type") == "page":
                    return str(target["webSocketDebuggerUrl"])
        time.sleep(0.2)
    raise ShotError("Chromium has no page target")


class Page:
    """Just enough of the DevTools protocol: commands by id; events are ignored.

    Written here rather than taken from Playwright or Selenium: four commands are all the script needs,
    and those libraries would add a driver (Playwright's wheel bundles Node.js) or a matching
    chromedriver to the dev dependencies for one script that a person runs now and then.
    """

    def __init__(self, ws: ClientConnection, width: int, height: int) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        ident = next(self.ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") != ident:
                continue
            if "error" in message:
                raise ShotError(f"{method}: {message['error'].get('message')}")
            result: dict[str, Any] = message.get("result", {})
            return result

    def text(self) -> str:
        result = self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''")
        return str(result.get("result", {}).get("value") or "")

    def wait_for(self, url: str, expect: tuple[str, ...], deadline: float) -> None:
        missing = list(expect)
        while time.monotonic() < deadline:
            text = self.text()
            missing = [want for want in expect if want not in text]
            if not missing:
                return
            time.sleep(1.0)
        raise ShotError(
            f"{url} did not render in time: the page never showed {missing} "
            "(is the Prefect server running with its UI? SLUICEGATE_PREFECT__UI=true)"
        )

    def click_tab(self, label: str) -> None:
        script = f"""(() => {{
            const label = {json.dumps(label)};
            const named = (selector) =>
                [...document.querySelectorAll(selector)].find((el) => el.textContent.trim() === label);
            const tab = named('[role="tab"], .p-tab') || named('button, a');
            if (!tab) return false;
            tab.click();
            return true;
        }})()"""
        if not self.call("Runtime.evaluate", expression=script).get("result", {}).get("value"):
            raise ShotError(f"no tab {label!r} on the page")

    def capture(self, shot: Shot, out: Path, timeout: float) -> Path:
        self.call("Page.navigate", url=shot.url)
        deadline = time.monotonic() + timeout
        self.wait_for(shot.url, shot.expect, deadline)
        if shot.tab:
            self.click_tab(shot.tab)
            self.wait_for(f"{shot.url} (tab {shot.tab})", shot.expect_tab, deadline)
        time.sleep(shot.settle)
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        path = out / shot.file
        path.write_bytes(base64.b64decode(data))
        return path


def check_not_blank(path: Path) -> str:
    """Raise when the PNG is (nearly) one colour; return a one-line description."""
    with Image.open(path) as image:
        rgb = image.convert("RGB")
        width, height = rgb.size
        colours = rgb.getcolors(maxcolors=width * height) or []
    dominant = max(count for count, _ in colours) / (width * height) if colours else 1.0
    if len(colours) < MIN_COLOURS or dominant > MAX_DOMINANT_SHARE:
        raise ShotError(
            f"{path} looks blank ({len(colours)} colours, {dominant:.0%} one colour): the page did not render"
        )
    return f"{width}x{height}, {len(colours)} colours, {path.stat().st_size // 1024} KiB"


# --- main ------------------------------------------------------------------------------------------


def plan(args: argparse.Namespace, mlflow: str, experiment: str) -> list[Shot]:
    api = args.api_url.rstrip("/")
    ui = api.removesuffix("/api")
    with httpx.Client(timeout=30) as client:
        try:
            client.get(f"{api}/health").raise_for_status()
        except httpx.HTTPError as exc:
            raise ShotError(f"the Prefect API at {api} does not answer ({exc}): run `sluicegate up` first") from exc
        page = client.get(f"{ui}/")
        if page.status_code >= 400 or "<html" not in page.text.lower():
            raise ShotError(f"{ui} serves no UI (HTTP {page.status_code}): start Prefect with its UI")
        run = pipeline_run(client, api, args.flow_run)
        run_id, name = run["id"], run["name"]
        print(f"flow run {name} ({run.get('state_name')}) {run_id}")
        artifacts = run_artifacts(client, api, run_id)
        summary = summary_artifact(artifacts)
        mlflow_run = None if args.no_mlflow else mlflow_run_url(client, mlflow.rstrip("/"), experiment, run_id)

    run_url = f"{ui}/runs/flow-run/{run_id}"
    shots = [
        Shot("prefect-flow-runs.png", f"{ui}/runs", (name,)),
        # The run graph (a canvas: nothing to wait for in the text, hence the settle) above the run's logs.
        # Not the Task Runs tab: Prefect 3.9's UI lists "No task runs" there although the API has them.
        Shot("prefect-pipeline-run.png", run_url, (name, "Task runs", "Logs"), settle=8.0),
    ]
    if artifacts:
        # The tab lists the flow run's own artifacts (the summary); the gate reports, made in task runs, are
        # on the Artifacts page and linked from the summary.
        keys = (summary["key"],) if summary is not None and summary.get("key") else ()
        shots.append(Shot("prefect-artifacts.png", run_url, (name,), tab="Artifacts", expect_tab=keys))
    else:
        print(f"flow run {name} has no artifacts; skipping the artifact screenshots", file=sys.stderr)
    if summary is not None:
        expect = (summary["key"],) if summary.get("key") else ()
        shots.append(Shot("prefect-summary.png", f"{ui}/artifacts/artifact/{summary['id']}", expect))
    if mlflow_run is not None:
        url, run_name = mlflow_run
        shots.append(Shot("mlflow-run.png", url, (run_name,), settle=4.0))
    return shots


def main() -> int:
    api_default, mlflow_default, experiment = default_urls()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--api-url", default=api_default, help=f"Prefect API URL (default {api_default})")
    parser.add_argument("--mlflow-url", default=mlflow_default, help=f"MLflow URL (default {mlflow_default})")
    parser.add_argument("--no-mlflow", action="store_true", help="skip the MLflow run page")
    parser.add_argument("--flow-run", help="flow run id to show (default: the newest pipeline run)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="folder for the PNGs")
    parser.add_argument("--browser", help="Chromium binary (default: the first of " + ", ".join(BROWSERS) + ")")
    parser.add_argument("--width", type=int, default=1440)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds each page may take to render")
    args = parser.parse_args()
    try:
        binary = find_browser(args.browser)
        shots = plan(args, args.mlflow_url, experiment)
        args.out.mkdir(parents=True, exist_ok=True)
        with browser(binary, args.width, args.height) as ws:
            page = Page(ws, args.width, args.height)
            for shot in shots:
                path = page.capture(shot, args.out, args.timeout)
                print(f"{os.path.relpath(path)}: {check_not_blank(path)}  <- {shot.url}")
    except (ShotError, httpx.HTTPError, TimeoutError) as exc:
        print(f"screenshots: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
