"""The pure core of the coordinator, one subpackage per subsystem (each ``__init__`` is its
public face):

- ``hashing/``: token ids -> chained, keyed page keys.
- ``index/``: which worker holds which page keys (``PrefixIndex``), and the typed page events
  (``PagesStored``, ``PagesRemoved``, ``WorkerCleared``) a batch applies to it.
- ``fleet/``: the registered workers, their load and serving version.
- ``routing/``: which worker a prompt runs on (``Router`` and the choosers).
- ``policy_state``: the weights version's state machine (``PolicyState``: idle, draining,
  applying; sync and async).
- ``rollout_records``, ``tier_costs``, ``errors``: values and domain refusals shared by the above.
- ``accel`` and ``_*_accel.pyx``: the optional compiled parts (holdings, page-key chain).

No grpc, redis, asyncio, socket, zmq, prometheus_client or structlog here (import-linter checks
it): the core takes time and randomness from its caller and returns facts rather than logging
them. This face imports nothing, so that a submodule's import never pulls in the rest.
"""
