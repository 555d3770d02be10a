"""``python -m autoddl``: the same command line as the ``autoddl`` script."""

from autoddl.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
