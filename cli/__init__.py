"""The command line. ``python -m verifier``: check, inspect, build, export, edit, watch,
explain, plot and accessible. It parses arguments, calls :mod:`workflow` (or the layers
below it) and prints (:mod:`cli.main`; the watcher's lines: :mod:`cli.watch`)."""
