"""Which version answers a request: the router (name, `name@alias`, `name@version`, traffic
splits) and the sticky bucket assignment it splits with."""

from hub.routing.router import Route, Router

__all__ = ["Route", "Router"]
