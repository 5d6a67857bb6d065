"""Per-key rate limits held across replicas: the fleet's token buckets, decided in memory at
the ingress (`limiter`), from the consumption of this replica and the others (`ledger`),
which every replica writes to and reads from SQL every sync interval (`sync`)."""
