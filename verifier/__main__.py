import gc
import sys

gc.disable()  # while the command's modules load: cli.main.settle freezes them and turns it on again

from cli.main import main  # noqa: E402  (the command line is the composition root: cli)

sys.exit(main())
