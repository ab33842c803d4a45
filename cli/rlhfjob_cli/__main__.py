"""`python -m rlhfjob_cli`: the `rlhfjob` command without its console script."""

from rlhfjob_cli import main

raise SystemExit(main())
