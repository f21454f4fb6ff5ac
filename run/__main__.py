"""`python -m tensorbus.run ...` is the `tensorbus` command too."""

import sys

from tensorbus.run.entry import main

sys.exit(main())
