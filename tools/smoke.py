"""``python -m tools.smoke``, as before: the smoke check is ``pegaflow.smoke`` (``pegaflow-smoke``)."""

import sys

from pegaflow.smoke import main

if __name__ == "__main__":
    sys.exit(main())
