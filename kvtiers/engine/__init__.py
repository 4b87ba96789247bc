"""Engine-side pieces: the scheduler glue an engine's connector runs each step, and the
simulated engine the demo, benchmarks and end-to-end tests drive."""
