"""The names of the recording rules that the engine reads: written by the mixin's rules
(mixin/straggler_rules.py), read by `flare diagnose` from Prometheus (engine/prometheus_source.py).

The straggler summary's records (straggler_summary_rules, with the per-window median and MAD of
straggler_recording_rules), as prometheus_source.from_prometheus reads them in place of every rank's windows.
"""

from __future__ import annotations

WINDOW_SHARE = "run_ago:flare_straggler_wait_share"  # :median and :mad, per window (ago)
SUMMARY_POOLED = "run_rank:flare_straggler_wait_share:pooled"
POOLED_SHARE = "run:flare_straggler_wait_share_pooled"  # :median and :mad
WINDOW_RANKS = "run_ago:flare_straggler_windows:ranks"
BEST_STEP_RANKS = "run:flare_straggler_best_step:ranks"
LAST_WINDOW = "run:flare_straggler_last_window"  # :min and :max
SUMMARY_AT = "run:flare_straggler_slowdown:min"  # written last: the time of the summary's figures
