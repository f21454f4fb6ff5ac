"""`python -m tensorbus ...` is the `tensorbus` command."""

import sys

from tensorbus.run.entry import main

sys.exit(main())
