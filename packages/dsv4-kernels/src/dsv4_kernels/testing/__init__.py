"""Input factories, poison values and seeds shared by tests, benchmarks, sweeps and probes."""
