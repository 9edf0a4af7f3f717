"""Instruments for the stability claims: monitors (validation loss among them), oscillation statistics, sensitivity,
theory, landscape."""

from .landscape import consistency_score, interpolate_loss, top_hessian_eigenvalue
from .monitors import GradNormMonitor, MagnitudeMonitor, Monitor, ProbeBatch, ProbeMonitor, UpdateRatioMonitor
from .sensitivity import jacobian_spectral_norm, perturbation_ratio, sensitivity_vs_t
from .stats import (
    coefficient_of_variation,
    count_spikes,
    detrended_std,
    mean_abs_delta,
    median_abs_log_delta,
    moving_average,
    oscillation_summary,
    spike_ratio,
)
from .theory import decoder_blocks, decoder_feature_norms, skip_energy, theory_fit
from .validation import ValidationMonitor, ValidationSet

__all__ = [
    "GradNormMonitor", "MagnitudeMonitor", "Monitor", "ProbeBatch", "ProbeMonitor", "UpdateRatioMonitor",
    "ValidationMonitor", "ValidationSet", "coefficient_of_variation", "consistency_score", "count_spikes",
    "decoder_blocks", "decoder_feature_norms", "detrended_std", "interpolate_loss", "jacobian_spectral_norm",
    "mean_abs_delta", "median_abs_log_delta", "moving_average", "oscillation_summary", "perturbation_ratio",
    "sensitivity_vs_t", "skip_energy", "spike_ratio", "theory_fit", "top_hessian_eigenvalue",
]
