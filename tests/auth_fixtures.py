"""An identities file for tests: one identity per role (two schedulers in two tenants, two
workers), with random tokens, written to a temporary directory."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class IdentityFile:
    path: Path
    tokens: dict[str, str]  # identity name -> bearer token

    def metadata(self, name: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[name]}"),)


# name -> (role, tenant, worker_id, subject)
IDENTITIES: dict[str, tuple[str, str, str | None, str | None]] = {
    "admin": ("admin", "", None, None),
    "sched-a": ("scheduler", "tenant-a", None, None),
    "sched-b": ("scheduler", "tenant-b", None, None),
    "trainer": ("trainer", "", None, "trainer-cert"),
    "w1": ("worker", "", "w1", "w1-cert"),
    "w2": ("worker", "", "w2", None),
}


def write_identities(directory: Path) -> IdentityFile:
    """Write ``IDENTITIES`` with fresh tokens as ``directory/identities.toml``."""
    tokens = {name: secrets.token_hex(16) for name in IDENTITIES}
    lines = []
    for name, (role, tenant, worker_id, subject) in IDENTITIES.items():
        lines += ["[[identity]]", f'name = "{name}"', f'role = "{role}"',
                  f'token = "{tokens[name]}"']
        if tenant:
            lines.append(f'tenant = "{tenant}"')
        if worker_id:
            lines.append(f'worker_id = "{worker_id}"')
        if subject:
            lines.append(f'subject = "{subject}"')
        lines.append("")
    path = directory / "identities.toml"
    path.write_text("\n".join(lines))
    return IdentityFile(path, tokens)
