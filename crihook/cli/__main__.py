"""`python -m crihook.cli`."""

import sys

from crihook.cli import main

sys.exit(main())
