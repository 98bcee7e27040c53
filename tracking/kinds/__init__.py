"""What each kind of run logs: training, transfer, interventions, equivalence, benchmarks, sweeps, figures."""
