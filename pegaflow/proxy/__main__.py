"""``python -m pegaflow.proxy``: the same as ``pegaflow-proxy``."""

import sys

from pegaflow.proxy.cli import main

sys.exit(main())
