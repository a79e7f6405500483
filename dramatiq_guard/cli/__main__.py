"""``python -m dramatiq_guard.cli``."""

import sys

from dramatiq_guard.cli import main

sys.exit(main())
