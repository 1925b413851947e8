"""Device meshes, axis roles, sharding rules and the collectives the layers use."""

from jaxmoe.parallel.mesh import DATA_AXIS, EXPERT_AXIS, build_mesh, role_axes, token_spec
from jaxmoe.parallel.sharding import ExpertParam, param_specs

__all__ = [
    "DATA_AXIS",
    "EXPERT_AXIS",
    "ExpertParam",
    "build_mesh",
    "param_specs",
    "role_axes",
    "token_spec",
]
