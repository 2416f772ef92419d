"""``python -m msgq_trio.bench [options]``: the same as ``msgq-trio bench [options]``."""

import sys

from .run import main

sys.exit(main())
