"""What a compiled step keeps, needs and costs: :func:`inspect`, :func:`compare` and the readers under them.

:mod:`~remat_kit.analysis.inspection` (residuals, needs, FLOPs of any loss), :mod:`~remat_kit.analysis.explain`
(what is live at the peak, the timeline, the no-op guardrails), :mod:`~remat_kit.analysis.memory` (a
compiled step's buffers, the host-offload rule), :mod:`~remat_kit.analysis.flops` (matmul FLOPs per
trip) and :mod:`~remat_kit.analysis._xla_dump` (the one reader of XLA's dump files).
"""

from remat_kit.analysis.inspection import Comparison, Inspection, compare, inspect

__all__ = ["Comparison", "Inspection", "compare", "inspect"]
