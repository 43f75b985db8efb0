"""`python -m pagoda.tools.doctor MODEL`: the same as `pagoda doctor MODEL`."""

import sys

from pagoda.tools.doctor.cli import main

sys.exit(main())
