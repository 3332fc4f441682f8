"""Fakes that run flare-exporter's real code paths without the hardware they stand in for."""

# The headers Prometheus 2.42 sends with a scrape: benchmarks that stand in for it ask for the same body.
PROMETHEUS_SCRAPE_HEADERS = {
    "Accept": (
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
        "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    ),
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/2.42.0",
    "X-Prometheus-Scrape-Timeout-Seconds": "10",
}
