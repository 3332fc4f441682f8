"""python -m flare_exporter.mixin.dashboards: write (or --check) the dashboards' JSON files."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
