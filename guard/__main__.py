"""``python -m guard``: see ``guard.run.cli``."""

import sys

from guard.run.cli import main

if __name__ == "__main__":
    sys.exit(main())
