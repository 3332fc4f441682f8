"""`python -m flare_exporter.launch`: the launcher's public name; it runs flare_exporter.rank.launch."""

from __future__ import annotations

import sys

from .rank.launch import main

if __name__ == "__main__":
    sys.exit(main())
