"""Which version answers a request: the router (name, `name@alias`, `name@version`, traffic
splits) and the sticky bucket assignment it splits with."""

from hub.routing.router import DecidedRouter, Route, Router

__all__ = ["DecidedRouter", "Route", "Router"]
