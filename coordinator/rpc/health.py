"""What every kvcoord gRPC server shares: health (open), reflection (guarded), a warning when
a server is reachable off loopback with auth off."""

from __future__ import annotations

import grpc
import structlog
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

from coordinator.rpc.guard import REFLECTION_PERMISSIONS, ServerSecurity
from coordinator.rpc.interceptor import ErrorMappingInterceptor

log = structlog.get_logger(__name__)


def add_health_and_reflection(
    server: grpc.aio.Server, errors: ErrorMappingInterceptor, service_name: str
) -> health_aio.HealthServicer:
    """The health service, open to all (kubelet probes carry no credentials), and reflection,
    admin-only when auth is on (it lists every method and message)."""
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        errors.wrap(ReflectionServicer(names),
                    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
                    REFLECTION_PERMISSIONS),
        server,
    )
    return health


def warn_if_open(listen: str, security: ServerSecurity) -> None:
    """A server off loopback without auth lets anyone on the network act as admin: say so."""
    host = listen.rpartition(":")[0].strip("[]")
    if not security.auth_on and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("security.auth_off", listen=listen,
                    hint="every caller is an admin; set auth_file (docs/SECURITY.md)")
