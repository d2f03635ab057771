"""Serving on the reference runtime: admission, one generation, the gRPC servicer, the
coordinator's policy commands.

- ``gate``: ``GenerationGate``, Generate calls in flight and the drain a policy update waits on.
- ``generations``: ``GenerationRunner``, one generation for every front end (gRPC, HTTP).
- ``servicer``: the ``worker.v1.Worker`` servicer; it converts and calls ``generations``.
- ``policy_commands``: DRAIN/APPLY/... from the coordinator, handled one at a time.
- ``in_order``: ``InOrder``, items run one at a time in arrival order (the bridge uses it too).

NOTE: this face imports nothing: ``servicer`` and ``generations`` pull in torch through the
runtime, and the bridge imports ``in_order`` without torch.
"""
