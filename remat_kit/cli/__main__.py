"""``python -m remat_kit.cli``: the same as the ``remat-kit`` console script."""

import sys

from remat_kit.cli import main

sys.exit(main())
