"""`python -m run ...` is `tensorbus ...` (how `local` starts its workers)."""

import sys

from run.entry import main

sys.exit(main())
