"""`pagoda serve`'s launcher: the preflight before any child starts (doctor's fast checks of the configs), and the
supervising image it execs once every check passed (`supervise.py`). The children themselves are started and
watched by `pagoda.processes.Supervisor`."""
