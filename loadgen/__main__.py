"""`python -m loadgen` is `genserve-loadgen`."""

import sys

from loadgen.cli import main

sys.exit(main())
