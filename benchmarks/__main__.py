"""``python -m benchmarks [options]`` from a checkout (see :func:`benchmarks.run.main`)."""

import sys

from .run import main

sys.exit(main())
