"""remat_kit: choose, apply and measure activation rematerialization in JAX/Flax."""

from remat_kit import names, policies
from remat_kit.budget import auto
from remat_kit.policies import Policy, parse
from remat_kit.scan import Stack, stack

__all__ = ["Policy", "Stack", "auto", "names", "parse", "policies", "stack"]
__version__ = "0.1.0"
