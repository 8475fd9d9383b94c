"""``python -m guard``: see ``guard.cli``."""

import sys

from guard.cli import main

if __name__ == "__main__":
    sys.exit(main())
