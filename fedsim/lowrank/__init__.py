"""Low-rank models: Pufferfish/Cuttlefish factorized layers, their ranks, and the server's switch to them."""
