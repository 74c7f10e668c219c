"""`python -m server ...` is the `spruce` command."""

import sys

from server.cli import main

sys.exit(main())
