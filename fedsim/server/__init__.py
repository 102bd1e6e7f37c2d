"""The ServerApp: the strategy that runs a scenario's rounds and the central evaluation."""
