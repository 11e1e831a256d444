"""`python -m baton.router`: the same as `baton router`."""
import sys

from baton.router.cli import main

sys.exit(main())
