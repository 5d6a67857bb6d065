"""Starting what benchmarks (and the tests that run the same topologies) measure against: a
`hub serve` process and its config file (`process`), a throwaway PostgreSQL (`postgres`), a
cluster of replicas sharing them (`cluster`), and the round-robin placement workload
(`round_robin`). Nothing here imports `tests`."""
