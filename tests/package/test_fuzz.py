"""Random input to the config loader, the web config parser and the exposition path: only documented errors.

- config: ConfigError (a ValueError) and nothing else, from YAML text, YAML documents, and FLARE_* values;
- web config: WebConfigError (a ConfigError);
- exposition: scrape.parse raises only ScrapeError; a snapshot built from scraped ranks raises only
  SourceError (no rank, several runs), and a rank whose exposition cannot be used is reported down.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from unittest import mock

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flare_exporter import config, spec
from flare_exporter.config import Config, ConfigError
from flare_exporter.engine import rank_client, records, scrape, scrape_source
from flare_exporter.engine.targets import Target
from flare_exporter.rank import web_config
from flare_exporter.rank.web_config import WebConfigError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
documents = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.one_of(st.text(max_size=20), st.integers()), children, max_size=5)
    ),
    max_leaves=20,
)
key_names = st.sampled_from([*config.FIELDS, "prot", "tls_server_config", ""]) | st.text(max_size=12)


@SETTINGS
@given(text=st.text(max_size=300))
def test_config_file_text(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "flare.yml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        loaded = config.load(flags={"config": str(path)}, environ={})
    except ConfigError as error:
        assert str(path) in str(error)
    else:
        assert isinstance(loaded, Config)


@SETTINGS
@given(raw=st.binary(max_size=200))
def test_config_file_bytes(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("fuzz") / "flare.yml"
    path.write_bytes(raw)
    try:
        config.load(flags={"config": str(path)}, environ={})
    except ConfigError as error:
        assert str(path) in str(error)


@SETTINGS
@given(document=st.dictionaries(key_names, documents, max_size=6))
def test_config_file_documents(tmp_path_factory, document):
    path = tmp_path_factory.mktemp("fuzz") / "flare.yml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True))
    try:
        loaded = config.load(flags={"config": str(path)}, environ={})
    except ConfigError as error:
        assert "\n" not in str(error)
    else:
        for name in document:
            assert getattr(loaded, name) is not None
        assert all(not isinstance(v, float) or math.isfinite(v) for v in vars(loaded).values())


environment_values = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=30
) | st.sampled_from(["nan", "inf", "-0", "1e9", "0x10", " 12 ", "true", "", "1_000", "٣"])


@SETTINGS
@given(
    environ=st.dictionaries(
        st.sampled_from([f"FLARE_{n.upper()}" for n in config.FIELDS]), environment_values
    )
)
def test_environment_values(environ):
    environ.pop("FLARE_CONFIG", None)  # would read a file of that name
    try:
        loaded = config.load(flags={}, environ=environ)
    except ConfigError as error:
        assert "environment variable FLARE_" in str(error)
    else:
        assert isinstance(loaded, Config)


@SETTINGS
@given(
    flags=st.dictionaries(st.sampled_from([n for n in config.FIELDS if n != "config"]), environment_values)
)
def test_flag_values(flags):
    try:
        config.load(flags=flags, environ={})
    except ConfigError as error:
        assert "flag --" in str(error)


web_sections = st.fixed_dictionaries(
    {},
    optional={
        "tls_server_config": st.dictionaries(
            st.sampled_from(sorted(web_config.TLS_KEYS | {"cipher_suites", "x"})), documents, max_size=6
        )
        | documents,
        "http_server_config": st.dictionaries(st.sampled_from(["headers", "http2", "y"]), documents)
        | documents,
        "basic_auth_users": st.dictionaries(
            st.text(max_size=8), documents | st.text(min_size=60, max_size=60)
        )
        | documents,
        "other": documents,
    },
)


@SETTINGS
@given(document=web_sections | documents)
def test_web_config_documents(document):
    try:
        parsed = web_config.parse(document, "/etc/flare/web.yml")
    except WebConfigError as error:
        assert "web config file /etc/flare/web.yml" in str(error) and "\n" not in str(error)
    else:
        assert isinstance(parsed, web_config.WebConfig)


# ---------------------------------------------------------------------------------------------------------
# exposition

label_values = st.text(max_size=12) | st.sampled_from(["0", "1", "world", "r", "-1", "NaN", "99999999999"])
sample_values = st.sampled_from(["1", "0", "NaN", "+Inf", "-Inf", "1e308", "-5", "3.5", "x", ""])
label_names = st.sampled_from(
    ["rank", "run", "group", "op", "state", "type", "world_size", "host", "le", "a b"]
)


@st.composite
def expositions(draw) -> str:
    """Text that looks like a rank's exposition: flare metric names, random labels and values, noise."""
    lines = []
    for _ in range(draw(st.integers(0, 12))):
        name = draw(st.sampled_from([m.name for m in spec.METRICS] + ["up", "flare_x", "9bad"]))
        labels = draw(st.dictionaries(label_names, label_values, max_size=5))
        if draw(st.booleans()):
            labels.setdefault("rank", draw(label_values))
            labels.setdefault("run", "r")
        body = ",".join(f'{k}="{v}"' for k, v in labels.items())
        if draw(st.booleans()):
            lines.append(
                f"# TYPE {name} {draw(st.sampled_from(['gauge', 'counter', 'info', 'histogram', 'x']))}"
            )
        lines.append(f"{name}{{{body}}} {draw(sample_values)}")
        if draw(st.integers(0, 9)) == 0:
            lines.append(draw(st.text(max_size=20)))
    text = "\n".join(lines) + ("\n" if draw(st.booleans()) else "")
    cut = draw(st.integers(0, len(text)))
    return text[:cut] if draw(st.integers(0, 4)) == 0 else text


@SETTINGS
@given(text=st.text(max_size=300) | expositions())
def test_exposition_parser(text):
    try:
        samples = scrape.parse(text, "host:1")
    except scrape.ScrapeError as error:
        assert str(error).startswith("host:1: malformed exposition")
    else:
        assert all(isinstance(sample.value, float) for sample in samples)


@SETTINGS
@given(texts=st.lists(expositions(), min_size=1, max_size=3), run=st.sampled_from(["", "r"]))
def test_snapshot_from_scraped_ranks(texts, run):
    targets = [Target(f"127.0.0.1:{9000 + i}", {"rank": str(i), "run": "r"}) for i in range(len(texts))]
    by_address = dict(zip([t.address for t in targets], texts, strict=True))

    asked = []

    def served(targets: list[str], *args: object) -> Iterator[tuple[str, str]]:
        for target in targets:
            asked.append(target)
            yield target, by_address[target]

    with mock.patch.object(rank_client, "exchange_all", served):
        try:
            snapshot = scrape_source.from_targets(targets, run=run)
        except records.SourceError:
            return
        finally:
            assert sorted(asked) == sorted(by_address)  # every text reached the parser, none the network
    for record in snapshot.ranks.values():
        assert isinstance(record.rank, int)
    from flare_exporter.engine import diagnosis

    diagnosis.diagnose(snapshot, hang_seconds=30)  # the engine copes with whatever a snapshot holds
