"""Differential privacy: the accountant that turns noise and sampling into ε (`accountant`) and
local DP on the clients (`local`). Central DP, DP-FedAvg, is a defense: defenses/dp_fedavg.py."""
