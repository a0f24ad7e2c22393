"""The daemon's side of engine workers: start, probe, drain, stop, and explain exits.

`supervisor` owns the worker processes, `client` is the one typed client of a
worker's Engine service (used here and by the data plane), `monitor` publishes
engine health as metrics, `forensics` reads why a worker exited. Nothing here loads
llama.cpp; the worker (`blazar.engine`) and this package share only the launch
document (`blazar.api.replicas.EngineLaunch`) and the engine proto.
"""
