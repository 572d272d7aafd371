"""The command line, ``python -m verifier COMMAND``. One module per command (its flags and
its ``run``, which calls :mod:`workflow` and prints), found by :data:`cli.main.COMMANDS`
(a new command is a new module here, with its ``ORDER`` in ``--help``); :mod:`cli.main` assembles the parser and maps
errors to exit statuses; :mod:`cli.common` holds what the commands share."""
