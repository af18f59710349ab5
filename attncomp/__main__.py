"""``python -m attncomp``: the command line (see :mod:`attncomp.cli`)."""

import sys

from .cli import main

sys.exit(main())
