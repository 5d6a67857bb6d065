"""The registry: what the hub should serve (SQL metadata + MLflow model registry)."""
