"""A live local web dashboard of a run: devices, rounds and time-to-accuracy, from the run directory alone."""
