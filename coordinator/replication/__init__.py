"""Replication: how coordinator replicas stay identical through the store's ``events`` stream
(``replicator``), what travels on it (``events``) and how a replica applies it (``apply``)."""
