"""tests/bench: the benchmarks' own logic on CPU (bench/), with bench-only dependencies
(transformers). `make test` runs this directory as its own pytest run after the core suite, so a
bench-only dependency can fail only this run, never the library's tests; both run on the locked
versions of requirements-lock.txt."""
