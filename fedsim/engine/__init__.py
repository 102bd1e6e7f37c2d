"""Running the apps: Flower's simulation engine on Ray (adjusted through fedsim/flower/compat.py),
the shared engine of sweeps, Ray's start, the light client actor, stopping a run. Imports nothing
at package level: the client actors import `fedsim.engine.ray_actor` and must stay light."""
