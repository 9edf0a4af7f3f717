"""What a run leaves on disk, written and read in one place: checkpoints, the run directory's config, the
metrics log and its plot, and self-describing exported model folders."""

from .checkpoint import (
    Checkpoint,
    CheckpointError,
    find_weights,
    latest_checkpoint,
    load_state,
    read_checkpoint,
    save_checkpoint,
)
from .metrics_log import MetricsLog, plot_curves, read_metrics, series, truncate_after
from .run_dir import (
    LoadedModel,
    RunDirError,
    check_run_dir,
    check_sample_shape,
    checkpoint_dir,
    export_model,
    is_model_folder,
    load_model,
    read_config,
    saved_sample_shape,
    source_config,
    write_config,
)

__all__ = [
    "Checkpoint", "CheckpointError", "LoadedModel", "MetricsLog", "RunDirError", "check_run_dir",
    "check_sample_shape", "checkpoint_dir", "export_model", "find_weights", "is_model_folder", "latest_checkpoint",
    "load_model", "load_state", "saved_sample_shape", "source_config",
    "plot_curves", "read_checkpoint", "read_config", "read_metrics", "save_checkpoint", "series",
    "truncate_after", "write_config",
]
