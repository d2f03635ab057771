"""gRPC serving plumbing shared by every kvcoord server (the coordinator's and the worker's):
identities and roles, the auth guard, the one interceptor that maps domain errors to status
codes, health and reflection. It holds no coordinator state."""
