"""``python -m kvtiers``: the same command line as the ``kvtiers`` script."""

from kvtiers.cli import main

raise SystemExit(main())
