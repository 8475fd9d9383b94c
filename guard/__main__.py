"""``python -m guard``: see ``guard.run.cli``."""

from guard.run.cli import entry

if __name__ == "__main__":
    entry()
