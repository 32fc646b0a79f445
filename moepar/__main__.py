"""`python -m moepar ...` is the `moepar` command."""

from moepar.cli import main

raise SystemExit(main())
