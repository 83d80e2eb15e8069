"""remat_kit: choose, apply and measure activation rematerialization in JAX/Flax."""

from remat_kit import names, policies
from remat_kit.policies import Policy, parse
from remat_kit.scan import Stack, stack

__all__ = ["Policy", "Stack", "names", "parse", "policies", "stack"]
__version__ = "0.1.0"
