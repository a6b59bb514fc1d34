"""``python -m tiering``: the ``tiering`` command."""

import sys

from tiering.apps.cli import main

sys.exit(main())
