"""``python -m headmoe``: the ``headmoe`` command (`headmoe.cli.main.main`)."""

import sys

from headmoe.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
