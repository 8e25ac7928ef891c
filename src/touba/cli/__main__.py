"""``python -m touba.cli``: the same command as ``touba``."""

from touba.cli import main

main()
