"""The coordinator's gRPC server: the servicer (translates and delegates), proto <-> domain
conversion, metrics, and ``main`` (starts and stops the process's server)."""
