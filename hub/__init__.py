"""Model Hub: one server for many models sharing one pool of accelerator memory."""

__version__ = "0.1.0"
