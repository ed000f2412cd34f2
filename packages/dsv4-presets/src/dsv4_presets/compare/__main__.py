"""``python -m dsv4_presets.compare``: the same as ``dsv4 compare``."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
