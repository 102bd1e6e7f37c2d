"""fedsim: simulate federated learning under attack, and defend it."""

__version__ = "0.1.0"
