"""`python -m trioserve ...` runs the same command line as the `trioserve`
console script (useful where the package is on PYTHONPATH but not installed)."""

import sys

from trioserve.cli import main

sys.exit(main())
