"""``python -m cdc.demo``: what ``make run`` starts."""

import sys

from .run import main

sys.exit(main())
