"""tensorbus's benchmarks, each beside its baseline in the same run: `python -m benchmarks`
lists them and runs any of them (benchmarks/README.md says what each measures)."""
