"""`python -m megarl` is the same as the `megarl` console script."""

from megarl.cli import main

raise SystemExit(main())
