"""The command line, ``python -m verifier COMMAND``. One module per command (its flags and
its ``run``, which calls :mod:`workflow` and prints), listed once in
:data:`cli.main.COMMANDS`; :mod:`cli.main` assembles the parser and maps errors to exit
statuses; :mod:`cli.common` holds what the commands share."""
