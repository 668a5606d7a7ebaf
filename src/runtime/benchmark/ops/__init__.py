"""One module per op; each exposes CASES, a list of runtime.benchmark.case.Case."""
