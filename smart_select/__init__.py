"""SMART for MLA + Mamba2 hybrids: per-layer KL sensitivity -> which layers keep attention.

:mod:`smart_select.stage` measures the sensitivities on the two ILD students (``upcycle smart``, the route's SMART
stage); :mod:`smart_select.selection` chooses the layers; :mod:`smart_select.report` writes the report and reads
the chosen layers back."""
from .report import layers_from_report, write_smart_report
from .selection import (is_valid_selection, select_layers, selection_rule, selection_sum, sensitivities,
                        validate_layers)

__all__ = ["sensitivities", "selection_rule", "select_layers", "is_valid_selection", "selection_sum",
           "validate_layers", "write_smart_report", "layers_from_report"]
