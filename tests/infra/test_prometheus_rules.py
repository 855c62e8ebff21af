"""Serving alerts and dashboard (infra/prometheus, infra/alertmanager, infra/grafana): promtool and amtool
accept them, every alert has a firing and a quiet unit test and a runbook section, and the rules and the
dashboard query only metrics the model server exports (every dashboard query returns data on them)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "infra" / "prometheus"
RULES = PROMETHEUS / "rules" / "sluicegate-serving.rules.yml"
RULE_TESTS = sorted((PROMETHEUS / "tests").glob("*.test.yml"))
CONFIG = PROMETHEUS / "prometheus.yml"
RUNBOOK = PROMETHEUS / "README.md"
ALERTMANAGER = ROOT / "infra" / "alertmanager" / "alertmanager.yml"
DASHBOARD = ROOT / "infra" / "grafana" / "sluicegate-serving.json"

MV = ("model", "version")
GPU = ("gpu", "uuid")
# What serving/ exports (issue "Serving observability"): name -> (type, labels).
EXPORTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "sluicegate_inference_request_duration_seconds": ("histogram", MV),
    "sluicegate_inference_requests_total": ("counter", (*MV, "code")),
    "sluicegate_queue_duration_seconds": ("histogram", MV),
    "sluicegate_batch_size": ("histogram", MV),
    "sluicegate_output_entropy_bits": ("histogram", MV),
    "sluicegate_output_entropy_collapse": ("gauge", MV),
    "sluicegate_feature_drift_ks_statistic": ("gauge", (*MV, "feature")),
    "sluicegate_feature_drift_p_value": ("gauge", (*MV, "feature")),
    "sluicegate_feature_drift_alarm": ("gauge", MV),
    "sluicegate_runtime_fallback_level": ("gauge", (*MV, "runtime")),
    "sluicegate_gpu_memory_used_bytes": ("gauge", GPU),
    "sluicegate_gpu_memory_total_bytes": ("gauge", GPU),
    "sluicegate_gpu_utilization_ratio": ("gauge", GPU),
    "sluicegate_gpu_temperature_celsius": ("gauge", GPU),
    "sluicegate_gpu_sm_clock_hertz": ("gauge", GPU),
    "sluicegate_gpu_thermal_throttle": ("gauge", GPU),
    "sluicegate_tensorrt_engine_cache_hits_total": ("counter", ()),
    "sluicegate_tensorrt_engine_cache_lookups_total": ("counter", ()),
    "sluicegate_server_ready": ("gauge", ()),
}
# A classic histogram is queried through its series; the bare name selects nothing.
SERIES = {
    f"{name}{suffix}"
    for name, (kind, _) in EXPORTED.items()
    for suffix in (("_bucket", "_sum", "_count") if kind == "histogram" else ("",))
}
EXPECTED_ALERTS = {
    "SluicegateInferenceLatencyHigh",
    "SluicegateInferenceErrorRateHigh",
    "SluicegateFeatureDrift",
    "SluicegateOutputEntropyCollapse",
    "SluicegateRuntimeFallbackActive",
    "SluicegateGPUThermalThrottling",
    "SluicegateGPUMemoryHigh",
    "SluicegateServerNotReady",
    "SluicegateServerDown",
}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIERS = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers left once strings, label matchers, ranges and
    label lists are removed, other than functions (followed by a parenthesis) and keywords."""
    for pattern in (_STRINGS, _MATCHERS, _RANGES, _LABEL_LISTS):
        expr = pattern.sub(" ", expr)
    return {name for name, call in _IDENTIFIERS.findall(expr) if not call and name.lower() not in _KEYWORDS}


def tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: run `bash scripts/system-deps.sh` (installs Debian's {package} package)")
    return found


def run(argv: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=120)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def query_panels() -> list[dict[str, Any]]:
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]  # rows only lay panels out


def label_values(variable: dict[str, Any]) -> tuple[str, str]:
    """A query variable's `label_values(selector, label)`, as (selector, label)."""
    found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"].strip())
    assert found, f"variable {variable['name']}: expected label_values(selector, label)"
    return found.group(1), found.group(2)


def dashboard_queries() -> dict[str, str]:
    """Every PromQL query of the dashboard, by where it is (panel title and refId, or variable name)."""
    queries = {
        f"{panel['title']} / {target['refId']}": target["expr"]
        for panel in query_panels()
        for target in panel["targets"]
    }
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            queries[f"variable {variable['name']}"] = label_values(variable)[0]
    return queries


# --- rules ---------------------------------------------------------------------------------------------------


def test_promtool_checks_the_rules_and_the_config() -> None:
    promtool = tool("promtool", "prometheus")
    result = run([promtool, "check", "rules", str(RULES)])
    assert result.returncode == 0, result.stdout + result.stderr
    result = run([promtool, "check", "config", str(CONFIG)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_the_rule_unit_tests_pass() -> None:
    promtool = tool("promtool", "prometheus")
    assert RULE_TESTS, "no infra/prometheus/tests/*.test.yml"
    for test_file in RULE_TESTS:
        rule_files = yaml.safe_load(test_file.read_text())["rule_files"]
        assert [(test_file.parent / path).resolve() for path in rule_files] == [RULES], test_file.name
    result = run([promtool, "test", "rules", *(path.name for path in RULE_TESTS)], cwd=PROMETHEUS / "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_test_case() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for test_file in RULE_TESTS:
        for case in yaml.safe_load(test_file.read_text())["tests"]:
            for alert_test in case.get("alert_rule_test", []):
                (fires if alert_test.get("exp_alerts") else quiet).add(alert_test["alertname"])
    assert set(alerts()) == EXPECTED_ALERTS
    assert EXPECTED_ALERTS - fires == set(), "alerts no test expects to fire"
    assert EXPECTED_ALERTS - quiet == set(), "alerts no test expects to stay quiet"


def test_every_alert_has_a_severity_annotations_and_a_runbook_section() -> None:
    anchors = {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), flags=re.M)
    }
    base = "https://github.com/sluicegate/sluicegate/blob/main/infra/prometheus/README.md#"
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), name
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(base) and url.removeprefix(base) == name.lower() in anchors, (name, url)


def test_rules_query_only_exported_metrics_and_recording_rules() -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    assert all(re.fullmatch(r"model_version:sluicegate_\w+:\w+", name) for name in recorded), recorded
    # up: the scrape's own series, the one way to see a server that exports nothing.
    allowed = SERIES | recorded | {"up"}
    for rule in rules():
        names = metric_names(rule["expr"])
        assert names and names <= allowed, (rule.get("record") or rule.get("alert"), names - allowed)


def test_the_name_check_reads_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (model, le) (rate(a_bucket{code!="OK", x=~"$v"}[$__rate_interval])))'
        " / on (model) group_left b offset 5m > bool 1e-3 and sum(c) without (gpu)"
        " or label_replace(d, 'x', 'y', 'z', '.*')"
    )
    assert metric_names(expr) == {"a_bucket", "b", "c", "d"}


# --- Prometheus and Alertmanager configuration --------------------------------------------------------------------


def test_prometheus_scrapes_the_side_port_every_15_seconds() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "sluicegate-serving"]
    assert job["scrape_interval"] == "15s" and job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["localhost:8000"]  # serving's http_port default
    assert [CONFIG.parent / pattern for pattern in config["rule_files"]] == [CONFIG.parent / "rules/*.rules.yml"]
    assert 'up{job="sluicegate-serving"}' in alerts()["SluicegateServerDown"]["expr"]


def test_amtool_checks_the_alertmanager_config_and_routes_by_severity() -> None:
    amtool = tool("amtool", "prometheus-alertmanager")
    result = run([amtool, "check-config", str(ALERTMANAGER)])
    assert result.returncode == 0, result.stdout + result.stderr
    for labels, receiver in (
        (["severity=critical", "model=pcb"], "page"),
        (["severity=warning", "model=pcb"], "ticket"),
        (["alertname=Other"], "ticket"),
    ):
        result = run([amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}", *labels])
        assert result.returncode == 0 and result.stdout.split() == [receiver], (labels, result.stdout, result.stderr)


def test_alertmanager_groups_by_model_and_critical_inhibits_warning() -> None:
    config = yaml.safe_load(ALERTMANAGER.read_text())
    assert "model" in config["route"]["group_by"]
    receivers = {receiver["name"]: receiver for receiver in config["receivers"]}
    assert set(receivers) == {"page", "ticket"}
    assert all(receiver["webhook_configs"][0]["url"].startswith("https://") for receiver in receivers.values())
    (inhibit,) = config["inhibit_rules"]
    assert 'severity="critical"' in inhibit["source_matchers"]
    assert inhibit["target_matchers"] == ['severity="warning"']
    assert "model" in inhibit["equal"]
    assert {rule["labels"]["severity"] for rule in alerts().values()} == {"critical", "warning"}


# --- Grafana dashboard -----------------------------------------------------------------------------------------


def test_dashboard_has_the_variables_and_every_panel_a_datasource_and_targets() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41 and board["uid"] == "sluicegate-serving"
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("model", "version"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"] == DATASOURCE
        selector, label = label_values(variables[name])
        assert label == name and re.match(r"sluicegate_inference_requests_total\b", selector), selector
    panels = query_panels()
    assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["datasource"] == DATASOURCE and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]


def test_dashboard_panels_do_not_overlap_and_cover_every_exported_metric() -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for cell in (
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        ):
            assert cell not in taken, f"{panel['title']} overlaps {taken[cell]}"
            taken[cell] = panel["title"]
    shown = {name for expr in dashboard_queries().values() for name in metric_names(expr)}
    exported = {name for name in EXPORTED if not any(series.startswith(name) for series in shown)}
    assert exported == set(), "exported metrics no panel shows"


def test_dashboard_queries_only_exported_metrics() -> None:
    for where, expr in dashboard_queries().items():
        names = metric_names(expr)
        assert names and names <= SERIES, (where, names - SERIES)


def _input_series() -> list[dict[str, str]]:
    """One scrape's worth of every exported metric, as the server would expose it, over 30 minutes."""
    series = []
    for name, (kind, labels) in EXPORTED.items():
        values = {"model": "pcb", "version": "v1", "code": "OK", "feature": "brightness", "runtime": "tensorrt"}
        values |= {"gpu": "0", "uuid": "GPU-0a1b", "job": "sluicegate-serving", "instance": "serving-0:8000"}
        selector = ",".join(f'{label}="{values[label]}"' for label in (*labels, "job", "instance"))
        if kind == "histogram":
            for le in ("0.1", "1.0", "+Inf"):
                series.append({"series": f'{name}_bucket{{{selector},le="{le}"}}', "values": "0+10x30"})
            series.append({"series": f"{name}_sum{{{selector}}}", "values": "0+5x30"})
            series.append({"series": f"{name}_count{{{selector}}}", "values": "0+10x30"})
        else:
            series.append({"series": f"{name}{{{selector}}}", "values": "0+10x30" if kind == "counter" else "1x30"})
    return series


def test_every_dashboard_query_returns_data_from_the_exported_metrics(tmp_path: Path) -> None:
    promtool = tool("promtool", "prometheus")
    queries = dashboard_queries()
    names = {f"DashboardQuery{index}": where for index, where in enumerate(queries)}
    empty_alerts = []
    for (alert, where), grafana_expr in zip(names.items(), queries.values(), strict=True):
        expr = re.sub(r"\$__\w+", "5m", grafana_expr)
        # Grafana's interval variables become a range; model and version one picked value (not "All", whose
        # ".*" would also match series without the label, hiding a filter on a label the metric lacks).
        promql = re.sub(r"\$\{?(\w+)\}?", lambda var: {"model": "pcb", "version": "v1"}[var[1]], expr)
        empty_alerts.append({"alert": alert, "expr": f"absent({promql})", "labels": {"query": where}})
    (tmp_path / "dashboard.rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": empty_alerts}]}))
    unit = {
        "rule_files": ["dashboard.rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": _input_series(),
                "alert_rule_test": [{"eval_time": "20m", "alertname": alert, "exp_alerts": []} for alert in names],
            }
        ],
    }
    (tmp_path / "dashboard.test.yml").write_text(yaml.safe_dump(unit))
    result = run([promtool, "test", "rules", "dashboard.test.yml"], cwd=tmp_path)
    # A failure names the alert and, in its query label, the panel whose query came back empty.
    assert result.returncode == 0, result.stdout + result.stderr
