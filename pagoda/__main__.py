"""`python -m pagoda` is the `pagoda` command."""

import sys

from pagoda.cli.main import main

sys.exit(main())
