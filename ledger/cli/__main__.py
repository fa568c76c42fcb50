"""``python -m ledger.cli``: the same as the ``ledger`` console script."""

import sys

from ledger.cli import main

sys.exit(main())
