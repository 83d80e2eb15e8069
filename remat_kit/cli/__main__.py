"""``python -m remat_kit.cli``: the same as the ``remat-kit`` console script."""

import sys

try:
    from remat_kit.cli import main
except KeyboardInterrupt:  # Ctrl-C in the instant before main's own handling is in place
    print("remat-kit: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
