"""`python -m steadydiff ...` (and `torchrun ... -m steadydiff train ...`): the `steadydiff` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
