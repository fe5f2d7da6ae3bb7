"""``python -m rollcage``."""

from rollcage.cli import main

main()
