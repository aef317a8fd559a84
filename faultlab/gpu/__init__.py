"""The H200 harness of faultlab's own engine (``faultlab bench``): the measurements, the step they time, timing."""
