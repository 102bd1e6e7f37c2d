"""The federation's clock: devices, networks and availability (`systems:`), each client-round timed
from the real bytes it received and sent and the samples it trained on, the round policies that
close a round on that clock, and AdaComm's local period chosen for simulated time (docs/clock.md)."""
