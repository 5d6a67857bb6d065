"""HTTP routes. Routers are thin: they validate, route, acquire, call the backend, shape."""
