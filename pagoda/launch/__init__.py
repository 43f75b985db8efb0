"""`pagoda serve`'s launcher steps before any child starts: the preflight (doctor's fast checks of the configs).
The children themselves are started and watched by `pagoda.processes.Supervisor`."""
