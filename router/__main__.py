import sys

from baton.router.cli import main

sys.exit(main())
