"""Per-key and per-key-and-model rate limits held across replicas: the fleet's token buckets
of each scope a request counts in (`scopes`), decided in memory at the ingress (`limiter`),
from the consumption of this replica and the others (`ledger`), which every replica writes
to and reads from SQL every sync interval (`sync`)."""
