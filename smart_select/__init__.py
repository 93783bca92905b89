"""SMART layer selection for MLA + Mamba2 hybrids: per-layer KL sensitivity -> which layers keep attention."""
from .report import write_smart_report
from .selection import (is_valid_selection, select_layers, selection_rule, selection_sum, sensitivities,
                        validate_layers)

__all__ = ["sensitivities", "selection_rule", "select_layers", "is_valid_selection", "selection_sum",
           "validate_layers", "write_smart_report"]
