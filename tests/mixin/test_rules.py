"""The Prometheus rules (`flare rules`, alerts/): current, valid, unit-tested per alert, and in step with the
spec and the runbook. End to end (a real Prometheus and Alertmanager paging on real faults) they are
exercised by tests/e2e/test_scenarios.py."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from flare_exporter import cli
from flare_exporter.durations import duration_seconds
from flare_exporter.engine.cli import EXIT_USAGE
from flare_exporter.local.alertmanager import EXAMPLE_CONFIG
from flare_exporter.mixin import dashboards, rules, rules_render

ALERTS = Path(__file__).resolve().parents[2] / "alerts"
RULES_FILE = ALERTS / "flare.rules.yml"
UNIT_TESTS = sorted((ALERTS / "tests").glob("*.test.yml"))
RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"

needs_promtool = pytest.mark.skipif(not shutil.which("promtool"), reason="promtool is not installed")


def flare_rules(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["rules", *args])
    return code, out.getvalue(), err.getvalue()


def alert_rules(document: dict) -> list[dict]:
    return [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]


def test_committed_rules_are_the_output_for_the_defaults(monkeypatch):
    monkeypatch.delenv("FLARE_HANG_SECONDS", raising=False)
    monkeypatch.delenv("FLARE_CONFIG", raising=False)
    code, out, _ = flare_rules()
    assert code == 0
    assert out == RULES_FILE.read_text(), "alerts/ is stale: run `flare rules > alerts/flare.rules.yml`"


@needs_promtool
def test_promtool_checks_the_rules():
    result = subprocess.run(["promtool", "check", "rules", str(RULES_FILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_pass():
    result = subprocess.run(
        ["promtool", "test", "rules", *map(str, UNIT_TESTS)], capture_output=True, text=True, cwd=ALERTS
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _seconds(text: str) -> float:
    return duration_seconds(text, "test")


def test_every_alert_is_unit_tested_firing_and_one_interval_before_it_fires():
    """Each alert has a promtool case in which it fires, and one evaluation interval earlier, in the same
    test, a case in which it must not (the step before for: expires, or before its threshold is met)."""
    covered = set()
    for path in UNIT_TESTS:
        document = yaml.safe_load(path.read_text())
        interval = _seconds(document["evaluation_interval"])
        for test in document["tests"]:
            cases = test.get("alert_rule_test", [])
            silent = {
                (case["alertname"], _seconds(case["eval_time"])) for case in cases if not case["exp_alerts"]
            }
            for case in cases:
                if (
                    case["exp_alerts"]
                    and (case["alertname"], _seconds(case["eval_time"]) - interval) in silent
                ):
                    covered.add(case["alertname"])
                for expected in case["exp_alerts"]:
                    assert set(expected["exp_annotations"]) == {
                        "summary",
                        "description",
                        "runbook_url",
                        "dashboard_url",
                    }
                    assert "severity" in expected["exp_labels"]
    named = {rule["alert"] for rule in alert_rules(yaml.safe_load(RULES_FILE.read_text()))}
    assert named - covered == set()


def test_unit_tests_evaluate_recording_rules_first_and_every_group():
    groups = [group["name"] for group in yaml.safe_load(RULES_FILE.read_text())["groups"]]
    for path in UNIT_TESTS:
        assert yaml.safe_load(path.read_text())["group_eval_order"] == groups, path.name


def test_the_culprit_alerts_are_alerts_that_name_a_rank():
    document = rules_render.rules_document(rules.Thresholds())
    summaries = {rule["alert"]: rule["annotations"]["summary"] for rule in alert_rules(document)}
    assert all("{{ $labels.rank }}" in summaries[alert] for alert in rules.CULPRIT_ALERTS)
    assert "{{ $labels.rank }}" not in summaries["FlareCollectiveHang"]


def test_every_alert_has_severity_annotations_and_a_runbook_section():
    sections = {
        re.sub(r"[^a-z0-9-]", "", heading.lower().replace(" ", "-"))
        for heading in re.findall(r"^## (.+)$", RUNBOOK.read_text(), re.M)
    }
    for rule in alert_rules(rules_render.rules_document(rules.Thresholds())):
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in sections, f"{rule['alert']}: docs/runbook.md has no section #{anchor}"
        assert re.match(r"^Flare[A-Z][A-Za-z]+$", rule["alert"])


def test_rules_name_only_metrics_the_spec_defines():
    document = rules_render.rules_document(rules.Thresholds())
    assert rules_render.unknown_metrics(document) == set()
    document["groups"][1]["rules"][0]["expr"] += " or flare_no_such_metric_total"
    document["groups"][0]["rules"][0]["expr"] += " or run:flare_undefined:rate5m"
    assert rules_render.unknown_metrics(document) == {
        "flare_no_such_metric_total",
        "run:flare_undefined:rate5m",
    }


def test_recording_rules_follow_level_metric_operation():
    for group in rules_render.rules_document(rules.Thresholds())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                level, metric, operation = rule["record"].split(":")
                assert set(level.split("_")) <= {
                    "run",
                    "group",
                    "rank",
                    "op",
                    "host",
                    "distribution",
                    "ago",
                    "phase",
                    "role",
                    "peer",
                }, rule["record"]
                assert metric.startswith("flare_") and operation


SLOW_GROUPS = {"flare.slow_signals", "flare.dead_runs", "flare.canary", "flare.perf", "flare.dashboards"}


def test_slow_signals_are_evaluated_every_slow_interval_and_the_rest_at_every_evaluation():
    def intervals(*args: str) -> dict[str, str | None]:
        code, out, _ = flare_rules(*args)
        assert code == 0
        return {group["name"]: group.get("interval") for group in yaml.safe_load(out)["groups"]}

    shipped = intervals()
    assert {name for name, interval in shipped.items() if interval == "1m"} == SLOW_GROUPS
    assert {interval for name, interval in shipped.items() if name not in SLOW_GROUPS} == {None}
    assert {name for name, interval in intervals("--slow-interval", "2m").items() if interval} == SLOW_GROUPS
    assert set(intervals("--slow-interval", "0s").values()) == {None}


def test_a_rule_reads_no_recording_of_a_slower_or_later_group():
    """The slow group's recordings are up to a minute old between its evaluations: only the alerts of the
    same group (evaluated right after them, in order) read them; every group may read the fast recordings."""
    document = rules_render.rules_document(rules.Thresholds())
    fast = {
        rule["record"]
        for group in document["groups"]
        if "interval" not in group
        for rule in group["rules"]
        if "record" in rule
    }
    assert "run_rank:flare_rank_info:host" in fast
    for group in document["groups"]:
        readable = set(fast)
        for rule in group["rules"]:
            assert set(rules_render.RECORDED.findall(rule["expr"])) <= readable, (group["name"], rule)
            if "record" in rule and "interval" in group:
                readable.add(rule["record"])


def test_short_thresholds_for_tests_follow_the_config(monkeypatch):
    monkeypatch.setenv("FLARE_HANG_SECONDS", "5")
    code, out, _ = flare_rules("--for", "0s", "--scrape-interval", "1s")
    assert code == 0
    document = yaml.safe_load(out)
    assert {rule["for"] for rule in alert_rules(document)} == {"0s"}
    hang = next(rule for rule in alert_rules(document) if rule["alert"] == "FlareCollectiveHang")
    assert hang["expr"].endswith(">= 5")
    failed = next(rule for rule in alert_rules(document) if rule["alert"] == "FlareRankFailed")
    assert ">= 2)" in failed["expr"]  # two scrape intervals to settle
    code, out, _ = flare_rules("--hang-seconds", "42")  # the flag beats the environment
    assert "max_age_seconds >= 42" in out


def test_the_ild_op_shift_threshold_follows_the_flag_then_the_environment(monkeypatch):
    def shifted_ks(out: str) -> str:
        document = yaml.safe_load(out)
        rules = [rule for group in document["groups"] for rule in group["rules"]]
        return next(
            r["expr"] for r in rules if r.get("record") == "run_rank_distribution:flare_ild_drift:shifted_ks"
        )

    monkeypatch.delenv("FLARE_ILD_OP_SHIFT_SECONDS", raising=False)
    assert ") >= 4e-07" in shifted_ks(flare_rules()[1])
    monkeypatch.setenv("FLARE_ILD_OP_SHIFT_SECONDS", "2.5e-8")
    assert ") >= 2.5e-08" in shifted_ks(flare_rules()[1])
    code, out, _ = flare_rules("--ild-op-shift-seconds", "1e-7")  # the flag beats the environment
    assert code == 0 and ") >= 1e-07" in shifted_ks(out) and "4e-07" not in shifted_ks(out)


def test_selector_scopes_every_series(tmp_path):
    code, out, _ = flare_rules("--selector", 'cluster="eu-1"')
    assert code == 0
    for rule in (rule for group in yaml.safe_load(out)["groups"] for rule in group["rules"]):
        for name in re.findall(r"(?<![\w:])(flare_[a-z0-9_]+|up)(?![\w:])(\{[^}]*\})?", rule["expr"]):
            assert 'cluster="eu-1"' in name[1], (rule, name)
    if shutil.which("promtool"):
        (tmp_path / "rules.yml").write_text(out)
        check = subprocess.run(
            ["promtool", "check", "rules", str(tmp_path / "rules.yml")], capture_output=True
        )
        assert check.returncode == 0, check.stdout


# Selectors Prometheus parses between { and }, as --selector takes them (braces optional), and the matchers
# each becomes in the rules.
GOOD_SELECTORS = {
    'cluster="eu-1"': 'cluster="eu-1"',
    '{cluster="eu-1"}': 'cluster="eu-1"',
    ' { cluster = "eu-1" , team!~"ml|infra", } ': 'cluster="eu-1", team!~"ml|infra"',
    "cluster='eu-1'": "cluster='eu-1'",
    r'cluster=~"eu-\\d+"': r'cluster=~"eu-\\d+"',  # the regex eu-\d+
    "cluster=~`eu-\\d+`": "cluster=~`eu-\\d+`",
    'cluster=~"(?i)EU-.*|us-[0-9]{1,3}"': 'cluster=~"(?i)EU-.*|us-[0-9]{1,3}"',
    'group="x", on="y"': 'group="x", on="y"',  # keywords are label names between braces
    'cluster=""': 'cluster=""',
    'cluster="caf\\u00e9"': 'cluster="caf\\u00e9"',
}
# Selectors Prometheus rejects (promtool: "could not parse expression"), and what --selector says.
BAD_SELECTORS = {
    "cluster=": "expected label matchers",
    "cluster=eu-1": "label values are quoted strings",
    'cluster=="eu-1"': "label values are quoted strings",
    '"cluster"="eu-1"': "expected label matchers",  # Prometheus 3's quoted names (QUOTED_NAMES)
    'cluster="eu-1" team="ml"': "expected a comma",
    'cluster="eu-1" or team="ml"': "expected a comma",
    'cluster="eu-1",,': "expected label matchers",
    ',cluster="eu-1"': "expected label matchers",
    '{cluster="eu-1"': "expected label matchers",
    'cluster="eu-1"}': "expected a comma",
    'cluster="eu-\\d"': "unknown escape sequence \\d",
    "cluster='it\\\"s'": "unknown escape sequence",
    'cluster="\\uD800"': "invalid Unicode code point",
    '__name__="up"': "__name__",
    'cluster=~"eu-("': "missing ), unterminated subpattern",
    'cluster=~"a)|(b"': "unbalanced parenthesis",
    'cluster=~"[z-a]"': "bad character range",
    'cluster=~"(?=eu)"': "Perl syntax",
    'cluster=~"(eu)\\\\1"': "Perl syntax",
    'cluster=~"eu*+"': "invalid nested repetition operator",
    'cluster=~"*eu"': "missing argument to repetition operator",
    'cluster=~"eu{1001}"': "invalid repeat count",
}
# Label names in quotes: Prometheus 3 parses them, 2.x does not; the rules are for either, so not taken.
QUOTED_NAMES = {'"cluster"="eu-1"'}


@pytest.mark.parametrize("selector, message", BAD_SELECTORS.items())
def test_a_selector_prometheus_would_reject_is_a_one_line_error(selector, message):
    code, out, err = flare_rules("--selector", selector)
    assert code == EXIT_USAGE and out == ""
    assert err.startswith("flare: flag --selector: ") and err.count("\n") == 1, err
    assert message in err


def test_selectors_prometheus_parses_are_taken_as_written(tmp_path):
    files = []
    for number, (selector, matchers) in enumerate(GOOD_SELECTORS.items()):
        code, out, err = flare_rules("--selector", selector)
        assert code == 0, err
        assert '{rank!="", run!="", ' + matchers + "}" in out, selector
        files.append(tmp_path / f"rules-{number}.yml")
        files[-1].write_text(out)
    if shutil.which("promtool"):
        check = subprocess.run(
            ["promtool", "check", "rules", *map(str, files)], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr


@needs_promtool
@pytest.mark.parametrize("selector", sorted(set(BAD_SELECTORS) - QUOTED_NAMES))
def test_promtool_rejects_what_the_selector_check_rejects(selector, tmp_path):
    """The BAD_SELECTORS are bad for Prometheus too, not only for the check: as they would land in a rule."""
    inner = selector.strip()
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1]
    path = tmp_path / "rules.yml"
    rule = {
        "record": "run_rank:flare_rank_info:count",
        "expr": f'count(flare_rank_info{{rank!="", {inner}}})',
    }
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [rule]}]}))
    check = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode != 0, selector


@pytest.mark.parametrize(
    "text, seconds", [("0s", 0), ("15s", 15), ("5m", 300), ("1h30m", 5400), ("1m500ms", 60.5), ("2d", 172800)]
)
def test_prometheus_durations_are_read_as_prometheus_reads_them(text, seconds):
    assert duration_seconds(text, "flag --window") == seconds


@pytest.mark.parametrize(
    "args, message",
    [
        (["--for", "1h 30m"], "flag --for: '1h 30m' is not a Prometheus duration"),
        (["--for", "5 minutes"], "flag --for: '5 minutes' is not a Prometheus duration"),
        (["--scrape-interval", "fast"], "flag --scrape-interval: 'fast' is not a Prometheus duration"),
        (["--slow-interval", "1 min"], "flag --slow-interval: '1 min' is not a Prometheus duration"),
        (["--hang-seconds", "-1"], "--hang-seconds"),
        (["--ild-op-shift-seconds", "0"], "flag --ild-op-shift-seconds"),
        (["--ild-op-shift-seconds", "fast"], "flag --ild-op-shift-seconds"),
        (["--bogus"], "unrecognized arguments"),
        (["--namespace", "monitoring"], "flag --namespace: only with --format prometheusrule"),
        (["--label", "release=prometheus"], "flag --label: only with --format prometheusrule"),
        (["--format", "prometheusrule", "--name", "Flare_Rules"], "flag --name: 'Flare_Rules' is not"),
        (["--format", "prometheusrule", "--namespace", "a.b"], "flag --namespace: 'a.b' is not"),
        (["--format", "prometheusrule", "--label", "release"], "flag --label: 'release' is not"),
        (["--format", "prometheusrule", "--label", "a/b/c=d"], "flag --label: 'a/b/c=d' is not"),
        (["--format", "prometheusrule", "--label", "team=ml infra"], "flag --label: 'team=ml infra' is not"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, message):
    code, out, err = flare_rules(*args)
    assert code == EXIT_USAGE and out == ""
    assert message in err and err.strip().count("\n") <= 2  # argparse adds its usage line


@pytest.mark.skipif(not shutil.which("amtool"), reason="amtool is not installed")
def test_alertmanager_example_is_valid_and_names_real_alerts():
    result = subprocess.run(["amtool", "check-config", str(EXAMPLE_CONFIG)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    assert config["route"]["group_by"] == ["run"]
    names = {rule["alert"] for rule in alert_rules(rules_render.rules_document(rules.Thresholds()))}
    for inhibit in config["inhibit_rules"]:
        for matcher in inhibit["source_matchers"] + inhibit["target_matchers"]:
            if matcher.startswith("alertname"):
                pattern = matcher.split("=", 1)[1].lstrip("~").strip('"')
                assert set(pattern.split("|")) <= names, matcher


def test_dashboard_urls_open_generated_dashboards():
    generated = {dashboard.path for dashboard in dashboards.dashboards()}
    assert set(rules.DASHBOARD_PATHS.values()) <= generated
    for rule in alert_rules(
        rules_render.rules_document(rules.Thresholds(grafana_url="https://grafana.example"))
    ):
        url = rule["annotations"]["dashboard_url"]
        assert url.startswith("https://grafana.example/d/") and "var-run={{ $labels.run }}" in url
        for name in re.findall(r"var-(\w+)=", url):
            assert name in ("run", "rank", "group") and name in dashboards.VARIABLES
