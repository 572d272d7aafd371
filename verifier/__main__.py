import sys

from cli.main import main  # the command line is the composition root (cli)

sys.exit(main())
