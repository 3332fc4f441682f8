"""Prometheus recording and alert rules, generated from one set of thresholds (`flare rules`).

    flare rules [--for DURATION] [--selector MATCHERS] [--scrape-interval DURATION]
                [--slow-interval DURATION] > rules.yml
    flare rules --format prometheusrule [--name NAME] [--namespace NS] [--label KEY=VALUE ...] [...]

--format prometheusrule prints the same groups in a prometheus-operator PrometheusRule (deploy/kubernetes/).
--selector takes label matchers as Prometheus does between { and } (e.g. 'cluster="eu-1"'); one it would
reject is an error (exit 2), not rules that no Prometheus loads.

The hang threshold is each run's own (the flare_hang_threshold_seconds its ranks export, from the
FLARE_HANG_SECONDS they were started with), as `flare diagnose` judges it, unless `flare rules` is told one
(--hang-seconds, FLARE_HANG_SECONDS, the config file): then that one, for every run. So the ranks' incident
files, `flare diagnose` and the alerts agree. `alerts/flare.rules.yml` is the
output for the defaults; a test regenerates it and fails when it differs.

The alerts make the rules engine's decisions (diagnosis.py) where PromQL can: the culprit of a hang is a
rank whose last issued sequence number is behind its group's maximum; a mismatch is a minority of ranks
ahead, or a different op or size at the same sequence number; a dead rank is one whose target is down
without an exception on record (the survivors' exceptions follow its death); of ranks that raised, the
first.

The slow signals' rules (issue latency, stragglers, GPU slowdowns, the exporter's own health) form one group,
`flare.slow_signals`, evaluated every `slow_interval` (1m) rather than at every evaluation as the fast ones
(liveness, hangs, GPU errors): their inputs are windows of many steps and their alerts hold for minutes,
while at thousands of ranks they are most of Prometheus's rule work (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import re
import sys

from .. import config as config_module
from ..durations import duration_seconds
from ..policies import IldPolicy
from .label_matchers import check_selector
from .rule_model import GRAFANA_URL, RUNBOOK_URL, Thresholds
from .rules_render import ResourceMeta, render


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--for", dest="for_", default=None, help="set every alert's for: (e.g. 0s in tests)")
    parser.add_argument("--selector", default="", help="extra label matchers, e.g. 'cluster=\"eu-1\"'")
    parser.add_argument(
        "--scrape-interval", default="15s", help="the flare job's scrape interval (default 15s)"
    )
    parser.add_argument(
        "--slow-interval",
        default=Thresholds.slow_interval,
        help="how often the slow signals' rules are evaluated (default 1m; 0s: at every evaluation)",
    )
    config_module.add_engine_arguments(parser)
    parser.add_argument("--runbook-url", default=RUNBOOK_URL, help="base URL of docs/runbook.md")
    parser.add_argument("--grafana-url", default=GRAFANA_URL, help="Grafana serving dashboards/")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=FORMATS[0],
        help="rules: a Prometheus rules file (default); prometheusrule: the same groups in a "
        "prometheus-operator PrometheusRule resource",
    )
    parser.add_argument(
        "--name", dest="resource_name", default=None, help="the PrometheusRule's name (default flare)"
    )
    parser.add_argument(
        "--namespace", dest="resource_namespace", default=None, help="the PrometheusRule's namespace"
    )
    parser.add_argument(
        "--label",
        dest="resource_labels",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a label of the PrometheusRule, e.g. the one its Prometheus's ruleSelector matches (repeatable)",
    )


def thresholds_from_args(args: argparse.Namespace) -> Thresholds:
    config = config_module.engine_config(args)
    slow = duration_seconds(args.slow_interval, "flag --slow-interval")
    t = Thresholds(
        selector=check_selector(args.selector),
        hang_seconds=config.hang_seconds
        if config_module.told_by(config_module.HANG_KEY, args.hang_seconds)
        else None,
        ild=IldPolicy(op_shift_seconds=config.ild_op_shift_seconds),
        scrape_interval_seconds=duration_seconds(args.scrape_interval, "flag --scrape-interval"),
        slow_interval=args.slow_interval if slow else "",
        runbook_url=args.runbook_url,
        grafana_url=args.grafana_url,
    )
    if args.for_ is not None:
        duration_seconds(args.for_, "flag --for")
        t = t.with_for(args.for_)
    return t


FORMATS = ("rules", "prometheusrule")
# Kubernetes' names: a DNS subdomain (object names, label key prefixes), a DNS label (namespaces), and a
# label key's name or a label value.
K8S_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")
K8S_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?")
K8S_LABEL_PART = re.compile(r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?")


def resource_from_args(args: argparse.Namespace) -> ResourceMeta | None:
    """The PrometheusRule's metadata for --format prometheusrule (None for a rules file); ConfigError for a
    name, namespace or label that Kubernetes would refuse, or for these flags without the format."""
    flags = {
        "--name": args.resource_name,
        "--namespace": args.resource_namespace,
        "--label": args.resource_labels,
    }
    if args.format != "prometheusrule":
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise config_module.ConfigError(f"flag {given[0]}: only with --format prometheusrule")
        return None
    name = ResourceMeta.name if args.resource_name is None else args.resource_name
    if not (K8S_SUBDOMAIN.fullmatch(name) and len(name) <= 253):
        raise config_module.ConfigError(
            f"flag --name: {name!r} is not a Kubernetes object name (lower case letters, digits, - and .)"
        )
    namespace = args.resource_namespace or ""
    if args.resource_namespace is not None and not (
        K8S_DNS_LABEL.fullmatch(namespace) and len(namespace) < 64
    ):
        raise config_module.ConfigError(
            f"flag --namespace: {namespace!r} is not a Kubernetes namespace (lower case letters, digits, -)"
        )
    return ResourceMeta(name, namespace, tuple(map(_k8s_label, args.resource_labels or ())))


def _k8s_label(item: str) -> tuple[str, str]:
    key, equals, value = item.partition("=")
    prefix, slash, name = key.rpartition("/")
    valid = (
        equals
        and K8S_LABEL_PART.fullmatch(name)
        and len(name) < 64
        and (not slash or (K8S_SUBDOMAIN.fullmatch(prefix) and len(prefix) <= 253))
        and (not value or (K8S_LABEL_PART.fullmatch(value) and len(value) < 64))
    )
    if not valid:
        raise config_module.ConfigError(
            f"flag --label: {item!r} is not a Kubernetes label KEY=VALUE such as release=prometheus"
        )
    return key, value


def main(args: argparse.Namespace) -> int:
    try:
        t = thresholds_from_args(args)
        resource = resource_from_args(args)
    except config_module.ConfigError as error:
        print(f"flare: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render(t, resource))
    return 0
