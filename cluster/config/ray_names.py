"""The names a deployment config must spell as Ray and Serve do: a model's Serve deployment name,
the application's name and Ray's accelerator types. Each check raises ``ConfigError`` naming the
config's key, before Ray or Serve start (where a wrong name fails late, or waits forever)."""

from __future__ import annotations

import difflib
import re

from engine.errors import ConfigError
from engine.validation import check_str, require


def deployment_name(model_id: str, role: str | None = None) -> str:
    """The Serve deployment of ``model_id``'s replicas: ``LLMServer:<model_id>``, with each
    character Serve's names reject replaced by ``-``; a disaggregated model's prefill pool is
    ``LLMServer:<model_id>:prefill`` (its decode pool has the model's name)."""
    name = "LLMServer:" + re.sub(r"[^A-Za-z0-9_.-]", "-", model_id)
    return name + ":prefill" if role == "prefill" else name


# Ray's accelerator type names (the values of ``ray.util.accelerators``, which Ray Serve LLM's
# ``accelerator_type`` is checked against): a node's resource is ``accelerator_type:<name>``,
# exactly so spelt. Listed here because this module must import without Ray (the ingress, the
# CLI); a test keeps the list equal to the installed Ray's.
RAY_ACCELERATOR_TYPES: frozenset[str] = frozenset((
    "V100", "P100", "T4", "P4", "K80", "A10G", "L4", "L40S", "A100", "A100-40G", "A100-80G",
    "H100", "H200", "H20", "B200", "B300", "GB200", "GB300", "RTX-PRO-6000",
    "Intel-GPU-Max-1550", "Intel-GPU-Max-1100", "Intel-GAUDI",
    "AMD-Instinct-MI100", "AMD-Instinct-MI250X", "AMD-Instinct-MI250X-MI250",
    "AMD-Instinct-MI210", "AMD-Instinct-MI300A", "AMD-Instinct-MI300X-OAM",
    "AMD-Instinct-MI300X-HF", "AMD-Instinct-MI308X", "AMD-Instinct-MI325X-OAM",
    "AMD-Instinct-MI350X-OAM", "AMD-Instinct-MI355X-OAM", "AMD-Radeon-R9-200-HD-7900",
    "AMD-Radeon-HD-7900", "aws-neuron-core", "TPU-V2", "TPU-V3", "TPU-V4", "TPU-V5P",
    "TPU-V5LITEPOD", "TPU-V6E", "TPU-V7X", "Ascend910B", "Ascend910B4", "MXC500", "MXC550",
    "FURIOSA_RNGD", "M1", "M1-Pro", "M1-Max", "M1-Ultra", "M2", "M2-Pro", "M2-Max", "M2-Ultra",
    "M3", "M3-Pro", "M3-Max", "Apple-Silicon", "MOBILINT_ARIES", "MOBILINT_REGULUS",
))  # fmt: skip

_APP_NAME = re.compile(r"[A-Za-z0-9_-]+")


def check_app_name(name: object, path: str) -> None:
    """The Serve application's name, as the Helm chart's schema allows it (``appName``):
    letters, digits, '_' and '-'. Serve itself refuses an empty name, but only once Ray and
    Serve have started."""
    check_str(name, path, non_empty=True, note="of letters, digits, '_' and '-'")
    require(
        _APP_NAME.fullmatch(str(name)) is not None,
        path,
        f"must be letters, digits, '_' and '-' only, got {name!r}",
    )


def check_model_id(model_id: str, path: str, seen: dict[str, str]) -> None:
    """A non-empty id whose Serve deployment name no earlier model's has: Serve would rename
    the second deployment, and the readiness and status lookups by name would then read the
    first model's replicas for both."""
    check_str(model_id, path, non_empty=True)
    require(model_id not in seen.values(), path, f"{model_id!r} is used by an earlier model")
    name = deployment_name(model_id)
    require(
        name not in seen,
        path,
        f"{model_id!r} has the Serve deployment name {name!r} of the earlier model "
        f"{seen.get(name)!r} (a character other than letters, digits, '_', '.' and '-' becomes "
        "'-'): choose ids that differ in those",
    )
    seen[name] = model_id


def check_accelerator_type(name: str | None, path: str) -> None:
    """None (no accelerator named), or one of Ray's accelerator type names, exactly so spelt:
    the replica's bundle asks for ``accelerator_type:<name>``, which no node has otherwise."""
    if name is None or name in RAY_ACCELERATOR_TYPES:
        return
    known = sorted(RAY_ACCELERATOR_TYPES)
    close = [t for t in known if t.lower() == str(name).lower()] or difflib.get_close_matches(
        str(name), known, n=3
    )
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ConfigError(
        f"{path}: unknown accelerator type {name!r}, not one of Ray's names "
        f"(ray.util.accelerators: H100, H200, A100-80G, L4, ...){hint}"
    )
